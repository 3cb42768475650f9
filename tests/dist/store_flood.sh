#!/usr/bin/env bash
# A job's store under a crowd of strangers from another host (a network
# namespace joined by a veth pair). `shardtrain train --nproc-per-node 2
# --max-restarts 1` trains on host 0, its store on host 0's veth address;
# from host 1, a process that knows no token keeps 1,100 idle connections
# open (more than the store ever kept for strangers) and floods it with
# thousands more opened and closed. Meanwhile one rank is SIGKILLed: the
# restarted ranks must get back into the store through the crowd, and the job
# must resume and finish, with the refusals logged as a few lines, not one
# per connection.
# Needs root (it creates and removes the namespaces); exits 77 (skipped) without.
set -euo pipefail
cli=$(readlink -f "$1") src=$2
here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
cd "$src"
[ "$(id -u)" = 0 ] && command -v ip >/dev/null || { echo "SKIP: needs root and iproute2 (CI runs as root; make deps installs iproute2)"; exit 77; }
unset SHARDTRAIN_SOCKET_IFNAME GLOO_SOCKET_IFNAME
ulimit -n 8192
tag=sf$$
net=10.$((100 + $$ % 50)).$(($$ % 250)).
work=$(mktemp -d)
source "$here/netns_hosts.sh"
trap 'touch "$work/stop"; hosts_down; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
hosts_up "$tag" "$net"
master=${HOST_ADDR[0]}
port=$((31000 + $$ % 1000))

ip netns exec "${HOST_NS[0]}" env SHARDTRAIN_TIMEOUT_S=60 "$cli" train --nproc-per-node 2 \
  --master-addr "$master" --master-port "$port" --max-restarts 1 \
  --set trainer.max_steps=200 --set trainer.eval_every=0 --set trainer.sample_tokens=0 \
  --set trainer.progress=none --set batch.global=4 --set batch.micro=2 --set batch.accumulate=null \
  --set model.n_layer=1 --set model.n_head=2 --set model.n_embd=32 --set model.block_size=32 \
  --set checkpoint.every_n_steps=2 --set distributed.strategy=ddp \
  --set distributed.threads_per_rank=1 --set run.dir="$work/run" >"$work/job.log" 2>&1 &
job=$!
# Any committed checkpoint: the oldest ones are pruned within milliseconds
# on this tiny model, so waiting for one by name could miss it.
until compgen -G "$work/run/checkpoints/step-*/COMMITTED" >/dev/null; do
  kill -0 "$job" 2>/dev/null || { cat "$work/job.log"; fail "the job ended before its first checkpoint"; }
  sleep 0.05
done
# The ranks, paused while the strangers gather (a tiny job would finish first).
ranks=()
for _ in $(seq 100); do
  ranks=()
  # The launcher's children but its fork server (src/launch/fork_server.h).
  ranks=($(pgrep -P "$job" -x shardtrain || true))
  [ "${#ranks[@]}" = 2 ] && break
  sleep 0.05
done
[ "${#ranks[@]}" = 2 ] || { cat "$work/job.log"; fail "did not find the job's 2 ranks"; }
kill -STOP "${ranks[@]}"

ip netns exec "${HOST_NS[1]}" python3 "$here/store_flood.py" "$master" "$port" 1100 90 \
  "$work/stop" >"$work/flood.log" 2>&1 &
flood=$!
until grep -q "horde of" "$work/flood.log"; do
  kill -0 "$flood" 2>/dev/null || { cat "$work/flood.log"; fail "the flood did not start"; }
  sleep 0.05
done
sleep 3  # the horde fills the store (and reconnects) and the flood runs
echo "SIGKILL to rank pid ${ranks[1]} while strangers crowd the store ($(ip netns exec "${HOST_NS[0]}" ss -Htn state established "( sport = :$port )" | wc -l) connections to it)"
kill -9 "${ranks[1]}"
kill -CONT "${ranks[0]}"
rc=0
wait "$job" || rc=$?
touch "$work/stop"
wait "$flood" || true
cat "$work/flood.log"
[ "$rc" = 0 ] || { cat "$work/job.log"; fail "the job exited $rc under the flood"; }
grep -q "resumed from step [0-9]* after restart 1" "$work/job.log" || {
  cat "$work/job.log"; fail "the restarted ranks did not resume"; }
made=$(sed -n 's/^made \([0-9]*\) connections/\1/p' "$work/flood.log")
[ "${made:-0}" -ge 3000 ] || fail "the flood made only ${made:-0} connections"
lines=$(grep -c "rendezvous store .* from ${HOST_ADDR[1]}:\|more connections to the rendezvous store" "$work/job.log" || true)
[ "$lines" -ge 1 ] || { cat "$work/job.log"; fail "the strangers were not logged"; }
[ "$lines" -le 20 ] || fail "$lines log lines for the strangers: one per connection"
echo "store flood OK: $made stranger connections, a rank killed and restarted, the job finished ($lines log lines)"
