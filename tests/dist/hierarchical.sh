#!/usr/bin/env bash
# Runs PROGRAM (a gtest binary) as a job over two hosts made of network
# namespaces joined by a veth pair, K ranks on each, each host's ranks
# started by its own `shardtrain launch --nnodes 2`. The program's
# collectives between hosts cross the veth; inside a host they use shared
# memory. Needs root; exits 77 (skipped) without.
#   hierarchical.sh K CLI PROGRAM [ARGS...]
set -euo pipefail
k=$1 cli=$(readlink -f "$2")
shift 2
[ "$(id -u)" = 0 ] && command -v ip >/dev/null || { echo "SKIP: needs root and iproute2 (CI runs as root; make deps installs iproute2)"; exit 77; }
unset SHARDTRAIN_SOCKET_IFNAME GLOO_SOCKET_IFNAME SHARDTRAIN_HIERARCHICAL
tag=sth$$
net=10.$((200 + $$ % 50)).$((($$ / 50) % 250)).
source "$(dirname "${BASH_SOURCE[0]}")/netns_hosts.sh"
trap hosts_down EXIT
hosts_up "$tag" "$net"
export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
port=$((29000 + $$ % 1000))
pids=()
for node in 0 1; do
  ip netns exec "${HOST_NS[node]}" "$cli" launch --nnodes 2 --node-rank "$node" --nproc-per-node "$k" \
    --master-addr "${HOST_ADDR[0]}" --master-port "$port" -- "$@" &
  pids+=($!)
done
# A failure anywhere wins over a skip (77), as in `shardtrain launch`.
rc=0
for p in "${pids[@]}"; do
  code=0
  wait "$p" || code=$?
  if [ "$code" != 0 ] && { [ "$rc" = 0 ] || [ "$rc" = 77 ]; }; then rc=$code; fi
done
exit $rc
