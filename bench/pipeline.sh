#!/usr/bin/env bash
# Pipeline parallelism: `make bench-pipeline` (needs root for the two hosts).
#
#   1. Bubble, one host: pp2 (one core per stage) under 1f1b, interleaved_1f1b
#      (2 stages per rank), zero_bubble and gpipe at m = 4, 8 and 16
#      micro-batches per step; the bubble each step's metrics measure
#      (pipeline_bubble: the ranks' idle time over their busy time) against
#      (p - 1) / m for 1f1b and gpipe and (p - 1) / (v m) for interleaved.
#   2. Slow link, one rank per host: two network-namespace hosts joined by a
#      veth pair shaped with tbf (each of RATES), pp2 across the hosts against
#      ddp x2 across the same hosts: tokens/s and the bytes that crossed the
#      link per step (the veth pair's counters).
#   3. Slow link, 2 hosts x 2 ranks: pp2 across the hosts x fsdp full_shard
#      inside each host, against hybrid_shard (sharded inside each host,
#      replicated across).
# The same global batch of 8 everywhere, each layout at its best micro-batch:
# data parallelism one micro-batch per rank and step (the largest GEMMs),
# the pipeline micro-batches of 1 (the most of them, the smallest bubble).
# The model is llama-25m (bench/train.sh's shape), fp32, one thread per rank.
# Writes the tables into BENCHMARKS.md between <!-- pipeline:begin --> and
# <!-- pipeline:end -->. Environment: BUILD_DIR (default build), RATES
# (default "1gbit 100mbit"), STEPS (default 6), WARM (default 2), PARTS
# (default "bubble link link4").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
RATES=${RATES:-"1gbit 100mbit"}
STEPS=${STEPS:-6}
WARM=${WARM:-2}
PARTS=${PARTS:-"bubble link link4"}
cli=$(readlink -f "$BUILD_DIR/shardtrain")
[ -x "$cli" ] || { echo "bench/pipeline.sh: no $cli; run make build first" >&2; exit 1; }
case " $PARTS " in *" link"*)
  [ "$(id -u)" = 0 ] || { echo "bench/pipeline.sh: the link parts need root (network namespaces)" >&2; exit 1; } ;;
esac

out=$(mktemp -d)
results="$out/results.jsonl"
: >"$results"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
model=(--set model.type=llama --set model.vocab_size=256 --set model.n_layer=8 --set model.n_head=8
       --set model.n_kv_head=2 --set model.n_embd=512 --set model.intermediate_size=1408
       --set model.block_size=256 --set precision=fp32 --set trainer.max_steps="$STEPS"
       --set trainer.eval_every=0 --set trainer.sample_tokens=0 --set trainer.log_every=1
       --set trainer.progress=none --set checkpoint.every_n_steps=0 --set distributed.threads_per_rank=1
       --set data.train=data/corpus.txt)

# summarize PART MODE RUN_DIR [LINK_BYTES_PER_STEP]: one results line.
summarize() {
  python3 - "$@" >>"$results" <<'PY'
import json, statistics, sys
part, mode, run = sys.argv[1], sys.argv[2], sys.argv[3]
link = float(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] not in ("", "-") else None
rows = [json.loads(l) for l in open(run + "/metrics.jsonl") if '"loss"' in l]
timed = [r for r in rows if r["step"] > int(sys.argv[5] if len(sys.argv) > 5 else 2)] or rows
out = {"part": part, "mode": mode, "strategy": rows[-1]["strategy"],
       "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
       "bubble": statistics.median(r["pipeline_bubble"] for r in timed) if "pipeline_bubble" in rows[-1] else None,
       "link_bytes_per_step": link, "blas_core": rows[-1].get("blas_core", "")}
print(json.dumps(out))
PY
  tail -n 1 "$results"
}

# ---- 1. bubble on one host -------------------------------------------------------------------
if [[ " $PARTS " == *" bubble "* ]]; then
  for schedule in 1f1b interleaved_1f1b zero_bubble gpipe; do
    for m in 4 8 16; do
      run="$out/bubble-$schedule-$m"
      env OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$cli" train "${model[@]}" --nproc-per-node 2 \
        --set distributed.strategy=ddp --set distributed.pipeline_parallel=2 \
        --set distributed.pipeline_schedule=$schedule --set batch.micro=1 --set batch.global=$m \
        --set batch.accumulate=null --set run.dir="$run" >"$run.log" 2>&1 ||
        { tail -n 5 "$run.log"; echo "{\"part\": \"bubble\", \"mode\": \"$schedule m=$m\", \"failed\": true}" >>"$results"; continue; }
      summarize bubble "$schedule m=$m" "$run" "" "$WARM"
    done
  done
fi

# ---- 2, 3. two hosts over a shaped link --------------------------------------------------------
if [[ " $PARTS " == *" link"* ]]; then
  source tests/dist/netns_hosts.sh
  trap 'hosts_down; rm -rf "$out"' EXIT
  hosts_up "stp$$" 10.78.0.
  link_bytes() {
    echo $(( $(ip netns exec "${HOST_NS[0]}" cat "/sys/class/net/${HOST_DEV[0]}/statistics/tx_bytes") +
             $(ip netns exec "${HOST_NS[1]}" cat "/sys/class/net/${HOST_DEV[1]}/statistics/tx_bytes") ))
  }
  last_step() {
    [ -f "$1/metrics.jsonl" ] || { echo 0; return; }
    tail -n 1 "$1/metrics.jsonl" | sed -n 's/.*"step": *\([0-9]*\).*/\1/p' | head -n 1
  }
  export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
  port=29800
  # two_hosts PART MODE PER_HOST MICRO ARGS...: one launcher per host, link bytes between steps WARM and STEPS.
  two_hosts() {
    local part=$1 mode=$2 per_host=$3 micro=$4; shift 4
    local run="$out/${part// /-}-$mode" pids=() start_bytes="" end_bytes="" rc=0
    port=$((port + 1))
    for node in 0 1; do
      ip netns exec "${HOST_NS[node]}" env OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$cli" train --nnodes 2 \
        --node-rank "$node" --nproc-per-node "$per_host" --master-addr "${HOST_ADDR[0]}" --master-port "$port" \
        "${model[@]}" --set batch.global=8 --set batch.micro="$micro" --set batch.accumulate=null "$@" \
        --set run.dir="$run" >"$run.$node.log" 2>&1 &
      pids+=($!)
    done
    while kill -0 "${pids[0]}" 2>/dev/null; do
      s=$(last_step "$run")
      [ -z "$start_bytes" ] && [ "${s:-0}" -ge "$WARM" ] && start_bytes=$(link_bytes)
      [ "${s:-0}" -ge "$STEPS" ] && { end_bytes=$(link_bytes); break; }
      sleep 0.05
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    if [ "$rc" != 0 ] || [ -z "$start_bytes" ] || [ -z "$end_bytes" ]; then
      tail -n 5 "$run".*.log
      echo "{\"part\": \"$part\", \"mode\": \"$mode\", \"failed\": true}" >>"$results"
      return
    fi
    summarize "$part" "$mode" "$run" "$(( (end_bytes - start_bytes) / (STEPS - WARM) ))" "$WARM"
  }
  op=add
  for rate in $RATES; do
    for d in 0 1; do
      ip netns exec "${HOST_NS[d]}" tc qdisc "$op" dev "${HOST_DEV[d]}" root tbf rate "$rate" burst 256kb latency 50ms
    done
    op=change
    if [[ " $PARTS " == *" link "* ]]; then
      two_hosts "link $rate" ddp 1 4 --set distributed.strategy=ddp
      two_hosts "link $rate" pp2 1 1 --set distributed.strategy=ddp --set distributed.pipeline_parallel=2
    fi
    if [[ " $PARTS " == *" link4 "* ]]; then
      two_hosts "link4 $rate" hybrid_shard 2 2 --set distributed.strategy=fsdp --set distributed.sharding=hybrid_shard
      two_hosts "link4 $rate" pp2-full_shard 2 1 --set distributed.strategy=fsdp \
        --set distributed.sharding=full_shard --set distributed.pipeline_parallel=2
    fi
  done
fi

LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
FLAGS=$(grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')
python3 - "$results" "$CPU" "$FLAGS" "$RATES" "$STEPS" "$WARM" "$LOAD_BEFORE" "$LOAD_AFTER" <<'PY'
import datetime, json, os, sys
sys.path.insert(0, "bench")
import benchlib
results, cpu, flags, rates, steps, warm, load0, load1 = sys.argv[1:9]
rows = benchlib.load_jsonl(results, "bench/pipeline.sh")
now = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC")
kernels = next((r["blas_core"] for r in rows if r.get("blas_core")), "?")
lines = ["<!-- pipeline:begin -->", "", "## Pipeline parallelism", "",
         f"- Run: {now}; `nproc` = {os.cpu_count()} ({cpu}; flags: {flags.strip()}; OpenBLAS kernels {kernels}); "
         f"load average {load0} before, {load1} after.",
         "- Command: `make bench-pipeline   # runs: bash bench/pipeline.sh`",
         "- Model: llama-25m (8 layers, n_embd 512, 2 key/value heads, context 256), fp32, one thread per rank; "
         f"{steps} steps, the first {warm} not timed (medians of the rest)."]
bubble = [r for r in rows if r["part"] == "bubble"]
if bubble:
    lines += ["", "### Bubble, one host (pp2, one core per stage, micro-batch 1)", "",
              "Measured: each step's `pipeline_bubble` (the ranks' idle time over their busy time, as the schedule "
              "simulator defines it). Theory: (p - 1) / m for 1f1b and gpipe, (p - 1) / (v m) for interleaved "
              "(v = 2); zero_bubble's ZB-H1 leaves less than 1f1b.", "",
              "| schedule | m | measured bubble | theory | tokens/s |", "|---|---:|---:|---:|---:|"]
    for r in bubble:
        if r.get("failed"):
            lines.append(f"| {r['mode']} | failed | | | |")
            continue
        schedule, m = r["mode"].split(" m=")
        m = int(m)
        theory = 1 / (2 * m) if schedule == "interleaved_1f1b" else 1 / m
        lines.append(f"| {schedule} | {m} | {r['bubble']:.3f} | {theory:.3f}"
                     f"{' (at most)' if schedule == 'zero_bubble' else ''} | {r['tokens_per_s']:.0f} |")
for kind, title, base, new in (("link", "one rank per host (micro-batch: ddp 4, pp 1)", "ddp", "pp2"),
                               ("link4", "2 ranks per host (micro-batch: hybrid_shard 2, pp 1)",
                                "hybrid_shard", "pp2-full_shard")):
    parts = [p for p in dict.fromkeys(r["part"] for r in rows) if p.split()[0] == kind]
    if not parts:
        continue
    lines += ["", f"### Two hosts over a shaped link (tbf), {title}", "",
              "| link | mode | strategy | tokens/s | link MB per step |", "|---|---|---|---:|---:|"]
    ratios = []
    for part in parts:
        got = {r["mode"]: r for r in rows if r["part"] == part}
        for r in got.values():
            if r.get("failed"):
                lines.append(f"| {part.split()[1]} | {r['mode']} | failed | | |")
                continue
            lines.append(f"| {part.split()[1]} | {r['mode']} | {r['strategy']} | {r['tokens_per_s']:.0f} | "
                         f"{r['link_bytes_per_step'] / 1e6:.1f} |")
        if base in got and new in got and not got[base].get("failed") and not got[new].get("failed"):
            a, b = got[base], got[new]
            ratios.append(f"- {part.split()[1]}: {new} against {base}: {b['tokens_per_s'] / a['tokens_per_s']:.2f}x "
                          f"the tokens/s, {b['link_bytes_per_step'] / a['link_bytes_per_step']:.3f}x the bytes "
                          "over the link.")
    lines += [""] + ratios if ratios else []
lines += ["", "<!-- pipeline:end -->"]
benchlib.write_section("BENCHMARKS.md", "<!-- pipeline:begin -->", "<!-- pipeline:end -->",
                       "\n".join(lines), "bench/pipeline.sh")
print("\n".join(lines))
PY
