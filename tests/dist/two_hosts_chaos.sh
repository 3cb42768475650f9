#!/usr/bin/env bash
# Restarts across two hosts (network namespaces joined by a veth pair), one
# rank each, under `shardtrain train --nnodes 2 --max-restarts 3`:
#   - while it trains, a process on host 1 that does not know the job token
#     connects to the store and is refused (host 0 logs it), and every socket
#     the job listens on is bound to host 0's veth address, none to all
#     interfaces;
#   - a random rank on a random host is SIGKILLed twice: both hosts restart
#     together and resume from the newest checkpoint;
#   - then host 1 dies entirely; host 0 waits for it, and when host 1's
#     launcher is started again the job comes back and finishes;
#   - the final parameters are bit-identical to an uninterrupted 2-rank run.
# Needs root (it creates and removes the namespaces); exits 77 (skipped) without.
set -euo pipefail
cli=$(readlink -f "$1") src=$2
shift 2
extra=("$@")  # more --set options: the same test under another layout (a pipeline)
cd "$src"
[ "$(id -u)" = 0 ] && command -v ip >/dev/null || { echo "SKIP: needs root and iproute2 (CI runs as root; make deps installs iproute2)"; exit 77; }
unset SHARDTRAIN_SOCKET_IFNAME GLOO_SOCKET_IFNAME
tag=sc$$
net=10.$((150 + $$ % 50)).$(($$ % 250)).
work=$(mktemp -d)
source "$(dirname "${BASH_SOURCE[0]}")/netns_hosts.sh"
trap 'hosts_down; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
trap 'echo "FAIL: line $LINENO: $BASH_COMMAND exited $?"' ERR
hosts_up "$tag" "$net"
master=${HOST_ADDR[0]}
port=$((30000 + $$ % 1000))
export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

common=(--set trainer.max_steps=30 --set trainer.eval_every=0 --set trainer.sample_tokens=0
        --set batch.global=8 --set batch.micro=2 --set batch.accumulate=null
        --set model.n_layer=2 --set model.n_embd=64 --set model.block_size=64
        --set checkpoint.every_n_steps=2 --set distributed.strategy=ddp
        --set distributed.threads_per_rank=1
        ${extra[@]+"${extra[@]}"})

"$cli" train "${common[@]}" --nproc-per-node 2 --set run.dir="$work/clean" >"$work/clean.log" 2>&1 ||
  { cat "$work/clean.log"; fail "the uninterrupted run failed"; }

launcher=()
# Starts node NODE's launcher on its host, appending to its log.
start_node() {
  local node=$1
  ip netns exec "${HOST_NS[node]}" env SHARDTRAIN_TIMEOUT_S=60 "$cli" train --nnodes 2 \
    --node-rank "$node" --nproc-per-node 1 --master-addr "$master" --master-port "$port" \
    --max-restarts 3 "${common[@]}" --set run.dir="$work/chaos" >>"$work/node$node.log" 2>&1 &
  launcher[node]=$!
}
logs() { for n in 0 1; do echo "--- node $n"; cat "$work/node$n.log"; done; }

# "<restarts> <step>" of the newest metrics line, or "".
latest() {
  [ -f "$work/chaos/metrics.jsonl" ] || return 0
  tail -n 1 "$work/chaos/metrics.jsonl" |
    sed -n 's/.*"step": *\([0-9]*\).*"restarts": *\([0-9]*\).*/\2 \1/p;s/.*"restarts": *\([0-9]*\).*"step": *\([0-9]*\).*/\1 \2/p' | head -n 1
}
# Waits until round K has logged step TARGET or later.
wait_for_step() {
  local k=$1 target=$2 r s
  until read -r r s <<<"$(latest)" && [ "${r:-}" = "$k" ] && [ "${s:-0}" -ge "$target" ]; do
    kill -0 "${launcher[0]}" 2>/dev/null || { logs; fail "node 0 ended before round $k reached step $target"; }
    sleep 0.02
  done
}

start_node 0
start_node 1
wait_for_step 0 2

# Only host 0's veth address listens, and a stranger is turned away.
listening=$(ip netns exec "${HOST_NS[0]}" ss -Hltn | awk '{print $4}')
echo "host 0 listens on:" $listening
grep -qx "$master:$port" <<<"$listening" || fail "the store does not listen on $master:$port"
if grep -Eq '^(0\.0\.0\.0|\*|\[::\]):' <<<"$listening"; then fail "a socket listens on every interface"; fi
ip netns exec "${HOST_NS[1]}" python3 - "$master" "$port" <<'PY' || fail "the stranger was not refused"
import os, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=15)
hello = b""
while len(hello) < 40:
    chunk = s.recv(40 - len(hello))
    assert chunk, "no greeting"
    hello += chunk
s.sendall(os.urandom(64))  # a guessed answer to the challenge
rest = s.recv(100)
assert rest == b"", f"the store answered a stranger: {rest!r}"
print("stranger refused")
PY
until grep -q "refused a connection to the rendezvous store .* from ${HOST_ADDR[1]}:" "$work/node0.log"; do
  kill -0 "${launcher[0]}" 2>/dev/null || { logs; fail "host 0 did not log the refused connection"; }
  sleep 0.1
done

# Two SIGKILLs of a random rank on a random host.
for k in 0 1; do
  wait_for_step "$k" $((3 + 9 * k + RANDOM % 6))
  node=$((RANDOM % 2))
  victim=""
  for _ in $(seq 100); do
    victim=$(pgrep -P "${launcher[node]}" -x shardtrain || true)  # not the fork server
    [ -n "$victim" ] && break
    sleep 0.1
  done
  [ -n "$victim" ] || { logs; fail "node $node has no rank to kill"; }
  echo "kill $((k + 1)): SIGKILL to node $node's rank (pid $victim)"
  kill -9 "$victim"
done

# Host 1 dies with everything on it; host 0 waits for it to come back.
wait_for_step 2 21
echo "host 1 goes down"
hosts_kill 1
wait "${launcher[1]}" 2>/dev/null || true
until grep -q "round 3: waiting for node 1" "$work/node0.log"; do
  kill -0 "${launcher[0]}" 2>/dev/null || { logs; fail "host 0 gave up instead of waiting for host 1"; }
  sleep 0.2
done
echo "host 1 comes back"
start_node 1
rc=0
wait "${launcher[0]}" || rc=$?
wait "${launcher[1]}" || rc=$?
[ "$rc" = 0 ] || { logs; fail "the job exited $rc"; }
grep -q "node 1 joined the job at round 3" "$work/node1.log" || { logs; fail "host 1 did not rejoin at round 3"; }
for k in 1 2 3; do
  grep -q "resumed from step [0-9]* after restart $k" "$work/node0.log" ||
    { logs; fail "restart $k did not resume"; }
done
cmp "$work/clean/model.safetensors" "$work/chaos/model.safetensors" ||
  fail "final parameters differ from the uninterrupted run"
echo "two-host chaos OK: stranger refused, 2 kills and a lost host, bit-identical final model"
