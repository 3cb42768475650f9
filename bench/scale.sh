#!/usr/bin/env bash
# Many ranks over many hosts (issue 27): HOSTS network-namespace hosts on one
# bridge, PPN ranks each (default 8 x 8 = 64), each host's launcher started as
# on a cluster: `shardtrain train --nnodes HOSTS --node-rank K --nproc-per-node
# PPN --master-addr <host 0> --master-port P`, sharing SHARDTRAIN_JOB_TOKEN.
# A tiny GPT, so what is measured is the job's machinery, not compute:
#
#   1. start-up: from starting the launchers to the first line of
#      metrics.jsonl; the store's connections (established TCP connections to
#      the master port in host 0), threads and RSS of host 0's launcher, and
#      rank 0's peak RSS; one fsdp hybrid_shard step (PPN-way shards inside a
#      host, replicated across hosts); a checkpoint of every rank's piece.
#   2. that checkpoint resumed at world 3 (host 0 alone, 3 ranks,
#      checkpoint.resume=auto).
#   3. a lost host: every launcher with --max-restarts 1; at step 3 every
#      process in the last host's namespace is killed, its launcher started
#      again with the same command; time from the kill to the first step of
#      the next round (a metrics line with restarts 1).
#
#   make bench-scale      (builds, then runs this; needs root)
#   bash bench/scale.sh   (when the build is there)
#
# Environment: BUILD_DIR (default build), CLI (default BUILD_DIR/shardtrain),
# HOSTS (default 8), PPN (default 8), WRITE (default 1: write the table into
# BENCHMARKS.md between <!-- scale:begin --> and <!-- scale:end -->; 0: print
# only), LOAD_NOTE (what else ran on the machine, for the table), PHASES
# (default "floor start resume lost"; the floor is every process of the job
# only loading the program, all at once: what start-up cannot beat). Needs about
# 180 MB per rank (12 GB at 64 ranks).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
CLI=${CLI:-$BUILD_DIR/shardtrain}
HOSTS=${HOSTS:-8}
PPN=${PPN:-8}
WRITE=${WRITE:-1}
LOAD_NOTE=${LOAD_NOTE:-}
PHASES=${PHASES:-"floor start resume lost"}
want() { [[ " $PHASES " == *" $1 "* ]]; }
floor=nan startup=nan store_conns=- launcher_threads=- launcher_rss=- pieces=- ckpt_mb=- resume_s=nan restart_s=nan
WORLD=$((HOSTS * PPN))
cli=$(readlink -f "$CLI")
[ "$(id -u)" = 0 ] || { echo "bench/scale.sh: needs root (it creates network namespaces)" >&2; exit 1; }
[ -x "$cli" ] || { echo "bench/scale.sh: no $cli; run make build first" >&2; exit 1; }
avail_mb=$(awk '/MemAvailable/ {print int($2 / 1024)}' /proc/meminfo)
need_mb=$((WORLD * 180 + 1024))
[ "$avail_mb" -ge "$need_mb" ] || {
  echo "bench/scale.sh: $WORLD ranks need about $need_mb MB, $avail_mb MB available; lower HOSTS or PPN" >&2; exit 1; }

out=$(mktemp -d)
source tests/dist/netns_hosts.sh
HOST_NS=()
trap 'hosts_down; rm -rf "$out"' EXIT
trap 'exit 1' INT TERM  # so a timeout or ^C still runs the clean-up above
hosts_up_n "sts$$" "10.$((100 + $$ % 50)).$(($$ % 250))." "$HOSTS"
master=${HOST_ADDR[0]}
port=$((30000 + $$ % 1000))
export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)

# Tiny model and small ranks: one thread each, no evaluation, no samples.
# batch.global 192 divides into whole micro-batches at world 64 (3 each) and
# at world 3 (64 each).
common=(--set model.n_layer=1 --set model.n_head=2 --set model.n_embd=32 --set model.block_size=32
        --set batch.global=$((WORLD * 3)) --set batch.micro=1 --set batch.accumulate=null
        --set trainer.eval_every=0 --set trainer.sample_tokens=0 --set trainer.log_every=1
        --set distributed.threads_per_rank=1
        --set distributed.strategy=fsdp --set distributed.sharding=hybrid_shard)
fail() { echo "bench/scale.sh: $*" >&2; tail -n 5 "$out"/*.log >&2 || true; exit 1; }
now() { date +%s.%N; }
since() { python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.2f}")' "$1" "$2"; }

# start_host NODE LOG ARGS...: host NODE's launcher in the background; its pid
# (ip netns exec and env both exec) goes to LAUNCHER[NODE].
declare -a LAUNCHER
start_host() {
  local node=$1 log=$2
  shift 2
  ip netns exec "${HOST_NS[node]}" env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 SHARDTRAIN_TIMEOUT_S=120 \
    "$cli" train --nnodes "$HOSTS" --node-rank "$node" --nproc-per-node "$PPN" \
    --master-addr "$master" --master-port "$port" "${common[@]}" "$@" >>"$log" 2>&1 &
  LAUNCHER[node]=$!
}
start_all() {  # LOGPREFIX ARGS...
  local prefix=$1 node
  shift
  for ((node = 0; node < HOSTS; node++)); do start_host "$node" "$out/$prefix.$node.log" "$@"; done
}
# Samples host 0's store (connections to the master port), its launcher's
# threads and RSS; keeps the largest of each in the named file.
sample_host0() {
  local conns threads rss
  conns=$(ip netns exec "${HOST_NS[0]}" ss -Htn state established "( sport = :$port )" 2>/dev/null | wc -l || true)
  threads=$(ls "/proc/${LAUNCHER[0]}/task" 2>/dev/null | wc -l || true)
  rss=$(awk '/VmRSS/ {print int($2 / 1024)}' "/proc/${LAUNCHER[0]}/status" 2>/dev/null || echo 0)
  read -r mc mt mr <"$1"
  echo "$((conns > mc ? conns : mc)) $((threads > mt ? threads : mt)) $((rss > mr ? rss : mr))" >"$1"
}
has_line() { grep -q "$2" "$1/metrics.jsonl" 2>/dev/null; }

# 0. The floor: every process of the job (HOSTS launchers, WORLD ranks) only
# loading the program and LibTorch, all at once, nothing else.
if want floor; then
t0=$(now)
floor_pids=()
for ((i = 0; i < WORLD + HOSTS; i++)); do
  OMP_NUM_THREADS=1 "$cli" --help >/dev/null 2>&1 &
  floor_pids+=($!)
done
for p in "${floor_pids[@]}"; do wait "$p" || fail "shardtrain --help failed"; done
floor=$(since "$t0" "$(now)")
echo "floor: ${floor}s for $((WORLD + HOSTS)) processes to load at once"
fi

# 1. Start-up, one hybrid_shard step, the checkpoint.
run="$out/run"
if want start; then
echo "0 0 0" >"$out/host0"
port=$((port + 1))
t0=$(now)
start_all start --set trainer.max_steps=3 --set run.dir="$run"
until has_line "$run" '"step"'; do
  kill -0 "${LAUNCHER[0]}" 2>/dev/null || fail "host 0's launcher ended before the first step"
  sample_host0 "$out/host0"
  sleep 0.1
done
t_first=$(now)
startup=$(since "$t0" "$t_first")
echo "start-up: ${startup}s to the first step at world $WORLD"
while kill -0 "${LAUNCHER[0]}" 2>/dev/null; do sample_host0 "$out/host0"; sleep 0.1; done
rc=0
for p in "${LAUNCHER[@]}"; do wait "$p" || rc=$?; done
[ "$rc" = 0 ] || fail "the $WORLD-rank run exited $rc"
read -r store_conns launcher_threads launcher_rss <"$out/host0"
ckpt=$(ls -d "$run"/checkpoints/step-* | tail -n 1)
pieces=$(ls "$ckpt" | grep -c "^rank-" || true)
ckpt_mb=$(du -sm "$ckpt" | cut -f1)
echo "store: $store_conns connections; host 0's launcher: $launcher_threads threads, ${launcher_rss} MB; checkpoint: $pieces pieces"
fi

# 2. Resume at world 3 on host 0 alone.
if want start && want resume; then
t0=$(now)
ip netns exec "${HOST_NS[0]}" env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$cli" train --nproc-per-node 3 \
  "${common[@]}" --set trainer.max_steps=4 --set checkpoint.resume=auto --set run.dir="$run" \
  >"$out/resume.log" 2>&1 || fail "resuming at world 3 failed"
resume_s=$(since "$t0" "$(now)")
# Resumed, not started afresh: the world-3 run logs step 4 alone.
[ "$(grep '"world_size": 3,' "$run/metrics.jsonl" | sed -n 's/.*"step": *\([0-9]*\),.*/\1/p' | tr '\n' ' ')" = "4 " ] ||
  fail "the world-3 run did not continue from the checkpoint of step 3"
echo "resume at world 3: ${resume_s}s for the whole run (load + one step + save)"
fi

# 3. A lost host, brought back.
lost="$out/lost"
if want lost; then
port=$((port + 1))
start_all lost --max-restarts 1 --set trainer.max_steps=100000 --set checkpoint.every_n_steps=2 --set run.dir="$lost"
until has_line "$lost" '"step": 3,'; do
  kill -0 "${LAUNCHER[0]}" 2>/dev/null || fail "the lost-host run ended early"
  sleep 0.1
done
victim=$((HOSTS - 1))
t_kill=$(now)
hosts_kill "$victim"
wait "${LAUNCHER[victim]}" 2>/dev/null || true
start_host "$victim" "$out/lost.$victim.again.log" --max-restarts 1 --set trainer.max_steps=100000 \
  --set checkpoint.every_n_steps=2 --set run.dir="$lost"
until has_line "$lost" '"restarts": 1'; do
  kill -0 "${LAUNCHER[0]}" 2>/dev/null || fail "host 0's launcher ended instead of restarting"
  sleep 0.1
done
restart_s=$(since "$t_kill" "$(now)")
echo "lost host $victim: ${restart_s}s from the kill to the next first step"
for ((node = 0; node < HOSTS; node++)); do hosts_kill "$node"; done 2>/dev/null
wait 2>/dev/null || true
fi

want start || cp "$lost/metrics.jsonl" "$run.metrics.jsonl"
want start && cp "$run/metrics.jsonl" "$run.metrics.jsonl"
python3 - "$run.metrics.jsonl" >"$out/steps.json" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
first = [r for r in rows if r["world_size"] != 3]
print(json.dumps({"step_s": statistics.median(r["step_time_s"] for r in first[1:]) if len(first) > 1 else first[0]["step_time_s"],
                  "rank0_rss_mb": first[-1]["peak_rss_mb"],
                  "max_rss_mb": max(first[-1].get("peak_rss_mb_ranks", [first[-1]["peak_rss_mb"]])),
                  "strategy": first[-1]["strategy"], "params": first[-1]["num_parameters"]}))
PY
cat "$out/steps.json"

CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
python3 - "$out/steps.json" "$CPU" "$HOSTS" "$PPN" "$startup" "$store_conns" "$launcher_threads" "$launcher_rss" \
  "$pieces" "$ckpt_mb" "$resume_s" "$restart_s" "$LOAD_BEFORE" "$LOAD_NOTE" "$WRITE" "$floor" <<'PY'
import datetime, json, os, sys
sys.path.insert(0, "bench")
import benchlib
(steps, cpu, hosts, ppn, startup, conns, threads, lrss, pieces, ckpt_mb, resume_s, restart_s,
 load, note, write, floor) = sys.argv[1:17]
s = json.load(open(steps))
world = int(hosts) * int(ppn)
now = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC")
goal = lambda v, bar: "not measured" if v == "nan" else "met" if float(v) < bar else "**not met**"
lines = ["<!-- scale:begin -->", "", f"## {world} ranks over {hosts} hosts", "",
         f"- Run: {now}; `nproc` = {os.cpu_count()} ({cpu}); load average before the run {load}"
         + (f"; {note}" if note else "") + ".",
         "- Command: `make bench-scale   # runs: bash bench/scale.sh` (HOSTS=8 PPN=8 by default)",
         f"- Set-up: {hosts} network-namespace hosts on one bridge, {ppn} ranks each, every host's launcher "
         f"`shardtrain train --nnodes {hosts} --node-rank K --nproc-per-node {ppn} --master-addr <host 0>`; "
         f"all {world} ranks share this machine's {os.cpu_count()} cores, one thread each.",
         f"- Model: GPT, 1 layer, n_embd 32, context 32 ({s['params']} parameters), micro-batch 1, "
         f"global batch {world * 3}; fsdp hybrid_shard ({ppn}-way shards inside a host, {hosts} replicas).",
         "", "| measure | value | goal |", "|---|---:|---|",
         f"| start-up: launch to the first metrics line | {float(startup):.1f} s | < 30 s: {goal(startup, 30)} |",
         f"| floor: {world + int(hosts)} processes only loading shardtrain and LibTorch, all at once | {float(floor):.1f} s | |",
         f"| store: connections to host 0's store (peak) | {conns} | |",
         f"| host 0's launcher: threads / RSS (peak) | {threads} / {lrss} MB | |",
         f"| rank 0 peak RSS (largest rank) | {s['rank0_rss_mb']:.0f} MB ({s['max_rss_mb']:.0f} MB) | |",
         f"| one hybrid_shard step (median after the first) | {s['step_s']:.2f} s | |",
         f"| checkpoint: pieces / size | {pieces} / {ckpt_mb} MB | |",
         f"| resume at world 3 (one host, 3 ranks): whole run, load + 1 step + save | {float(resume_s):.1f} s | |",
         f"| lost host: kill of every process of host {int(hosts) - 1} to the next first step | {float(restart_s):.1f} s | < 60 s: {goal(restart_s, 60)} |",
         "", "<!-- scale:end -->"]
text = "\n".join(lines)
if write == "1":
    benchlib.write_section("BENCHMARKS.md", "<!-- scale:begin -->", "<!-- scale:end -->", text, "bench/scale.sh")
print(text)
PY
