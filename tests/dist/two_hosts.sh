#!/usr/bin/env bash
# Two hosts made of Linux network namespaces joined by a veth pair, 2 ranks
# each, started as a user would on two machines: `shardtrain launch --nnodes 2
# --node-rank R --master-addr <host 0>` with no interface variable set. Each
# rank must pick the interface that routes to the master (not loopback), and
# ddp and fsdp hybrid_shard must log the single-process run's losses. The
# hybrid run is started by `shardtrain train --nnodes 2 ...` itself. Then
# host 1 dies mid-run and host 0 must stop promptly, naming the lost node.
# Needs root (it creates and removes the namespaces); exits 77 (skipped) without.
set -euo pipefail
cli=$(readlink -f "$1") src=$2
cd "$src"
[ "$(id -u)" = 0 ] && command -v ip >/dev/null || { echo "SKIP: needs root and iproute2 (CI runs as root; make deps installs iproute2)"; exit 77; }
unset SHARDTRAIN_SOCKET_IFNAME GLOO_SOCKET_IFNAME
tag=st$$
net=10.$((200 + $$ % 50)).$(($$ % 250)).
work=$(mktemp -d)
source "$(dirname "${BASH_SOURCE[0]}")/netns_hosts.sh"
trap 'hosts_down; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
hosts_up "$tag" "$net"
master=${HOST_ADDR[0]}
# Launchers started separately share the job's secret.
export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

# Starts `shardtrain ARGS... --master-addr <host 0> --master-port PORT` on
# node NODE's host, output to LOG, in the background; its pid goes to pids.
start_on() {
  local node=$1 log=$2
  shift 2
  ip netns exec "${HOST_NS[node]}" env SHARDTRAIN_TIMEOUT_S=60 "$@" >"$log" 2>&1 &
  pids+=($!)
}

common=(--set trainer.max_steps=3 --set trainer.eval_every=0 --set trainer.sample_tokens=0
        --set batch.global=8 --set batch.micro=2 --set batch.accumulate=null
        --set model.n_layer=2 --set model.n_embd=64 --set model.block_size=64)

losses() { python3 -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1]) if "\"loss\"" in l))' "$1"; }

"$cli" train "${common[@]}" --set distributed.strategy=single --set run.dir="$work/single" >/dev/null 2>&1 ||
  fail "the single-process reference run failed"
reference=$(losses "$work/single/metrics.jsonl")

port=$((29000 + $$ % 1000))
for strategy in ddp hybrid; do
  extra=(--set distributed.strategy=ddp)
  [ "$strategy" = hybrid ] && extra=(--set distributed.strategy=fsdp --set distributed.sharding=hybrid_shard)
  run="$work/$strategy"
  port=$((port + 1))
  pids=()
  for node in 0 1; do
    # ddp through `shardtrain launch`, hybrid through `shardtrain train`'s own launch options.
    hosts=(--nnodes 2 --node-rank "$node" --nproc-per-node 2 --master-addr "$master" --master-port "$port")
    launch=("$cli" launch "${hosts[@]}" -- "$cli" train)
    [ "$strategy" = hybrid ] && launch=("$cli" train "${hosts[@]}")
    start_on "$node" "$work/$strategy.$node.log" "${launch[@]}" "${common[@]}" "${extra[@]}" \
      --set run.dir="$run"
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  [ "$rc" = 0 ] || { cat "$work/$strategy".*.log; fail "$strategy across two hosts exited $rc"; }
  grep -q "network: ${HOST_DEV[0]} $master (routes to $master)" "$work/$strategy.0.log" || {
    cat "$work/$strategy.0.log"; fail "$strategy: rank 0 did not report the veth interface it chose"; }
  # The world spans two hosts (network namespaces): its collectives cross the link.
  if grep "network:" "$work/$strategy.0.log" | grep -q "shared memory"; then
    cat "$work/$strategy.0.log"; fail "$strategy: a world across two hosts claims shared memory"; fi
  got=$(losses "$run/metrics.jsonl")
  python3 - "$reference" "$got" "$strategy" <<'PY' || fail "$strategy: losses differ from the single-process run"
import sys
ref = [float(x) for x in sys.argv[1].split()]
got = [float(x) for x in sys.argv[2].split()]
print(sys.argv[3], "losses", got, "single", ref)
assert len(ref) == 3 and len(got) == 3, "expected 3 steps each"
for r, g in zip(ref, got):
    assert abs(r - g) <= 1e-5 * max(1.0, abs(r)), (r, g)
PY
done
echo "two hosts OK: ddp and hybrid_shard match the single process"

# Node loss: every rank of host 1 dies mid-run; host 0's ranks stop at once
# (well within the collective timeout) with an error naming the lost node.
run="$work/loss"
port=$((port + 1))
pids=()
for node in 0 1; do
  start_on "$node" "$work/loss.$node.log" "$cli" train --nnodes 2 --node-rank "$node" \
    --nproc-per-node 2 --master-addr "$master" --master-port "$port" "${common[@]}" \
    --set trainer.max_steps=100000 --set distributed.strategy=ddp --set run.dir="$run"
done
until grep -q '"step": 3,' "$run/metrics.jsonl" 2>/dev/null; do
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$work/loss.0.log"; fail "node-loss run ended early"; }
  sleep 0.1
done
hosts_kill 1
start=$SECONDS
rc=0
wait "${pids[0]}" || rc=$?
wait "${pids[1]}" 2>/dev/null || true
took=$((SECONDS - start))
[ "$rc" != 0 ] || fail "host 0 exited 0 after losing host 1"
[ "$took" -le 30 ] || fail "host 0 took ${took}s to stop after losing host 1"
grep -q "on node 1: global ranks 2..3" "$work/loss.0.log" || {
  cat "$work/loss.0.log"; fail "host 0's error does not name the lost node"; }
echo "node loss OK: host 0 stopped in ${took}s (exit $rc), naming node 1"
