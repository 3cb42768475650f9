#!/usr/bin/env bash
# The slim suite version of `make bench-scale`: 4 network-namespace hosts on
# one bridge (hosts_up_n), 2 ranks each, every host's launcher started as on a
# cluster (`shardtrain train --nnodes 4 --node-rank K ...`) with fsdp
# hybrid_shard (2-way shards inside a host, 4 replicas) and --max-restarts 1.
# The job must start and log the single-process run's losses for its first
# steps; then every process of host 3 is killed, its launcher started again
# with the same command, and the job must come back (a metrics line with
# restarts 1) within SHARDTRAIN_TIMEOUT_S, every host taking part again.
# Needs root (it creates and removes the namespaces); exits 77 (skipped) without.
set -euo pipefail
cli=$(readlink -f "$1") src=$2
cd "$src"
[ "$(id -u)" = 0 ] && command -v ip >/dev/null || { echo "SKIP: needs root and iproute2 (CI runs as root; make deps installs iproute2)"; exit 77; }
unset SHARDTRAIN_SOCKET_IFNAME GLOO_SOCKET_IFNAME
hosts=4 ppn=2
work=$(mktemp -d)
source "$(dirname "${BASH_SOURCE[0]}")/netns_hosts.sh"
HOST_NS=()
trap 'hosts_down; rm -rf "$work"' EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*"; tail -n 5 "$work"/*.log 2>/dev/null || true; exit 1; }
hosts_up_n "stm$$" "10.$((150 + $$ % 50)).$(($$ % 250))." "$hosts"
master=${HOST_ADDR[0]}
port=$((31000 + $$ % 1000))
export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

common=(--set model.n_layer=1 --set model.n_head=2 --set model.n_embd=32 --set model.block_size=32
        --set batch.global=8 --set batch.micro=1 --set batch.accumulate=null
        --set trainer.eval_every=0 --set trainer.sample_tokens=0 --set distributed.threads_per_rank=1)
losses() { python3 -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1]) if "\"loss\"" in l and json.loads(l)["step"] <= 3))' "$1"; }

OMP_NUM_THREADS=1 "$cli" train "${common[@]}" --set trainer.max_steps=3 --set distributed.strategy=single \
  --set run.dir="$work/single" >/dev/null 2>&1 || fail "the single-process reference run failed"
reference=$(losses "$work/single/metrics.jsonl")

run="$work/run"
declare -a launcher
start_host() {
  ip netns exec "${HOST_NS[$1]}" env OMP_NUM_THREADS=1 SHARDTRAIN_TIMEOUT_S=40 "$cli" train \
    --nnodes "$hosts" --node-rank "$1" --nproc-per-node "$ppn" --master-addr "$master" --master-port "$port" \
    --max-restarts 1 "${common[@]}" --set trainer.max_steps=100000 --set checkpoint.every_n_steps=2 \
    --set distributed.strategy=fsdp --set distributed.sharding=hybrid_shard --set run.dir="$run" \
    >>"$work/host$1.log" 2>&1 &
  launcher[$1]=$!
}
# wait_for PATTERN SECONDS WHAT: until metrics.jsonl has PATTERN, while host 0's launcher lives.
wait_for() {
  local until=$((SECONDS + $2))
  until grep -q "$1" "$run/metrics.jsonl" 2>/dev/null; do
    kill -0 "${launcher[0]}" 2>/dev/null || fail "host 0's launcher ended before $3"
    [ "$SECONDS" -lt "$until" ] || fail "no $3 within $2 s"
    sleep 0.1
  done
}
start=$SECONDS
for ((node = 0; node < hosts; node++)); do start_host "$node"; done
wait_for '"step": 3,' 60 "step 3"
echo "started: step 3 at world $((hosts * ppn)) after $((SECONDS - start)) s"
grep -q '"world_size": 8,.*"strategy": "fsdp/hybrid_shard"' "$run/metrics.jsonl" ||
  fail "the metrics do not say world 8, fsdp/hybrid_shard"
got=$(losses "$run/metrics.jsonl")
python3 - "$reference" "$got" <<'PY' || fail "hybrid_shard over 4 hosts: losses differ from the single-process run"
import sys
ref = [float(x) for x in sys.argv[1].split()]
got = [float(x) for x in sys.argv[2].split()]
print("4 hosts x 2 losses", got, "single", ref)
assert len(ref) == 3 and len(got) == 3, "expected 3 steps each"
for r, g in zip(ref, got):
    assert abs(r - g) <= 1e-5 * max(1.0, abs(r)), (r, g)
PY

# A lost host: every process of host 3 dies; its launcher comes back.
hosts_kill 3
wait "${launcher[3]}" 2>/dev/null || true
killed=$SECONDS
start_host 3
wait_for '"restarts": 1' 90 "a step after the restart"
took=$((SECONDS - killed))
echo "lost host: back at a first step $took s after the kill"
grep -q "node 3 joined the job at round" "$work/host3.log" || fail "host 3's new launcher does not say it joined the running job"
for ((node = 0; node < hosts; node++)); do hosts_kill "$node"; done 2>/dev/null
wait 2>/dev/null || true
echo "many hosts OK: 4 hosts x 2 ranks started, matched the single process, and came back from a lost host in $took s"
