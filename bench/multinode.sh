#!/usr/bin/env bash
# Two hosts over a slow link (issue 11): two network namespaces joined by a
# veth pair shaped with netem (RATE, DELAY; tbf, rate only, where the kernel
# has no netem), 2 ranks on each, the 25 M
# parameter GPT trained with ddp, fsdp full_shard and fsdp hybrid_shard, ddp
# and full_shard also with flat rings across hosts (SHARDTRAIN_HIERARCHICAL=0,
# modes ddp-flat and full_shard-flat) against the default hierarchical
# collectives. For each: tokens/s, bytes that crossed the host link per optimizer step (the
# veth pair's kernel counters, both directions, between the metrics lines of
# step WARM and the last step) and rank 0's peak RSS. Writes the table into
# BENCHMARKS.md between <!-- multinode:begin --> and <!-- multinode:end -->.
#
#   make bench-multinode      (builds, then runs this; needs root)
#   bash bench/multinode.sh   (when the build is there)
#
# Environment: BUILD_DIR (default build), RATE (default 1gbit), DELAY
# (default 1ms), STEPS (default 6), WARM (default 2), MODES (default
# "ddp-flat ddp full_shard-flat full_shard hybrid_shard"). Both "hosts" share this machine's cores:
# compute is the same for every mode, the link is what differs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
RATE=${RATE:-1gbit}
DELAY=${DELAY:-1ms}
STEPS=${STEPS:-6}
WARM=${WARM:-2}
MODES=${MODES:-"ddp-flat ddp ddp-mpi full_shard-flat full_shard full_shard-mpi hybrid_shard"}
cli=$(readlink -f "$BUILD_DIR/shardtrain")
[ "$(id -u)" = 0 ] || { echo "bench/multinode.sh: needs root (it creates network namespaces)" >&2; exit 1; }
[ -x "$cli" ] || { echo "bench/multinode.sh: no $cli; run make build first" >&2; exit 1; }

out=$(mktemp -d)
source tests/dist/netns_hosts.sh
trap 'hosts_down; rm -rf "$out"' EXIT
hosts_up "stb$$" 10.77.0.
# netem gives rate and delay; kernels without sch_netem get tbf (rate only).
SHAPE="netem, $RATE, $DELAY each way"
shape() {  # namespace device
  ip netns exec "$1" tc qdisc add dev "$2" root netem rate "$RATE" delay "$DELAY" 2>/dev/null && return
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$RATE" burst 256kb latency 50ms
  SHAPE="tbf, $RATE each way; no added delay: this kernel has no sch_netem"
}
shape "${HOST_NS[0]}" "${HOST_DEV[0]}"
shape "${HOST_NS[1]}" "${HOST_DEV[1]}"

link_bytes() {
  echo $(( $(ip netns exec "${HOST_NS[0]}" cat "/sys/class/net/${HOST_DEV[0]}/statistics/tx_bytes") +
           $(ip netns exec "${HOST_NS[1]}" cat "/sys/class/net/${HOST_DEV[1]}/statistics/tx_bytes") ))
}
last_step() {
  [ -f "$1/metrics.jsonl" ] || { echo 0; return; }
  tail -n 1 "$1/metrics.jsonl" | sed -n 's/.*"step": *\([0-9]*\).*/\1/p' | head -n 1
}

model=(--set model.n_layer=8 --set model.n_head=8 --set model.n_embd=512 --set model.block_size=256
       --set batch.micro=2 --set batch.global=8 --set batch.accumulate=null
       --set trainer.max_steps="$STEPS" --set trainer.eval_every=0 --set trainer.sample_tokens=0
       --set trainer.log_every=1 --set distributed.threads_per_rank=1)
results="$out/results.jsonl"
: >"$results"
port=29700
# Launchers started separately share the job's secret.
export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
# The -mpi modes: one mpirun across both hosts (mpirun_two_hosts, no ssh);
# the ranks run on the mpi backend over Open MPI's TCP.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_hwloc_base_binding_policy=none
export OMPI_MCA_btl_vader_single_copy_mechanism=none

for mode in $MODES; do
  hier=1
  case $mode in *-flat) hier=0 ;; *-mpi) hier=mpi ;; esac
  case ${mode%-*} in
    ddp) extra=(--set distributed.strategy=ddp) ;;
    full_shard) extra=(--set distributed.strategy=fsdp --set distributed.sharding=full_shard) ;;
    hybrid_shard) extra=(--set distributed.strategy=fsdp --set distributed.sharding=hybrid_shard) ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
  run="$out/$mode"
  port=$((port + 1))
  pids=()
  if [ "$hier" = mpi ]; then
    mpirun_two_hosts "$out" stb 10.77.0. 2 -x OPENBLAS_NUM_THREADS=1 -x OMP_NUM_THREADS=1 \
      "$cli" train "${model[@]}" "${extra[@]}" --set distributed.backend=mpi --set run.dir="$run" \
      >"$out/$mode.0.log" 2>&1 &
    pids+=($!)
  else
    for node in 0 1; do
      ip netns exec "${HOST_NS[node]}" env OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
        SHARDTRAIN_HIERARCHICAL=$hier "$cli" train --nnodes 2 \
        --node-rank "$node" --nproc-per-node 2 --master-addr "${HOST_ADDR[0]}" --master-port "$port" \
        "${model[@]}" "${extra[@]}" --set run.dir="$run" >"$out/$mode.$node.log" 2>&1 &
      pids+=($!)
    done
  fi
  start_bytes=""
  while kill -0 "${pids[0]}" 2>/dev/null; do
    s=$(last_step "$run")
    [ -z "$start_bytes" ] && [ "${s:-0}" -ge "$WARM" ] && start_bytes=$(link_bytes)
    [ "${s:-0}" -ge "$STEPS" ] && { end_bytes=$(link_bytes); break; }
    sleep 0.05
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  if [ "$rc" != 0 ] || [ -z "$start_bytes" ]; then
    echo "$mode failed (exit $rc):"; tail -n 5 "$out/$mode".*.log
    echo "{\"mode\": \"$mode\", \"failed\": true}" >>"$results"
    continue
  fi
  python3 - "$run/metrics.jsonl" "$mode" "$WARM" "$STEPS" "$start_bytes" "$end_bytes" "$hier" >>"$results" <<'PY'
import json, statistics, sys
path, mode, warm, steps, b0, b1 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
across = ("MPI (Open MPI over TCP)" if sys.argv[7] == "mpi" else
          "hierarchical" if sys.argv[7] == "1" and not mode.startswith("hybrid") else "flat rings")
rows = [json.loads(l) for l in open(path) if '"loss"' in l]
timed = [r for r in rows if r["step"] > warm]
print(json.dumps({"mode": mode, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
                  "link_bytes_per_step": (b1 - b0) / (steps - warm),
                  "peak_rss_mb": rows[-1]["peak_rss_mb"], "params": rows[-1].get("num_parameters", 0),
                  "strategy": rows[-1]["strategy"], "across": across,
                  "losses": [r["loss"] for r in rows]}))
PY
  tail -n 1 "$results"
done

LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
FLAGS=$(grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')
python3 - "$results" "$CPU" "$FLAGS" "$SHAPE" "$STEPS" "$WARM" "$LOAD_BEFORE" "$LOAD_AFTER" <<'PY'
import datetime, json, os, sys
sys.path.insert(0, "bench")
import benchlib
results, cpu, flags, shape, steps, warm, load0, load1 = sys.argv[1:9]
rows = benchlib.load_jsonl(results, "bench/multinode.sh")
now = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC")
lines = ["<!-- multinode:begin -->", "", "## Two hosts over a slow link", "",
         f"- Run: {now}; `nproc` = {os.cpu_count()} ({cpu}; flags: {flags.strip()}); load average "
         f"{load0} before, {load1} after (other builds shared the machine when it is above ~1: "
         "tokens/s then spread; the link bytes do not depend on it).",
         "- Command: `make bench-multinode   # runs: bash bench/multinode.sh`",
         f"- Set-up: two network-namespace hosts joined by a veth pair shaped with {shape}, "
         "2 ranks per host started by `shardtrain train --nnodes 2`, one thread per rank; both hosts share this "
         "machine's cores, so compute is alike for every mode and the link is what differs.",
         f"- Model: GPT, 8 layers, n_embd 512, context 256, micro-batch 2 per rank, global batch 8, fp32; {steps} steps, "
         f"the first {warm} not timed. Link bytes: the veth pair's tx counters, both directions, per optimizer step.",
         "- Across hosts: `hierarchical` (the default: reduce inside each host through shared memory, one ring per "
         "local rank between hosts) or `flat rings` (`SHARDTRAIN_HIERARCHICAL=0`: one ring through all 4 ranks). "
         "hybrid_shard's groups are one host or one rank per host, so it never goes hierarchical. "
         "`-mpi` rows: the same job started by one `mpirun -np 4` across both hosts, on the mpi backend "
         "(Open MPI's own collectives over its TCP transport).",
         "", "| mode | strategy | across hosts | tokens/s | link MB per step | rank 0 peak RSS MB |",
         "|---|---|---|---:|---:|---:|"]
for r in rows:
    if r.get("failed"):
        lines.append(f"| {r['mode']} | failed | — | — | — | — |")
        continue
    lines.append(f"| {r['mode']} | {r['strategy']} | {r['across']} | {r['tokens_per_s']:.0f} | "
                 f"{r['link_bytes_per_step'] / 1e6:.1f} | {r['peak_rss_mb']:.0f} |")
by_mode = {r["mode"]: r for r in rows if not r.get("failed")}
pairs = [m for m in ("ddp", "full_shard") if m in by_mode and m + "-flat" in by_mode]
lines += [""] if pairs else []
for mode in pairs:
    a, b = by_mode[mode], by_mode[mode + "-flat"]
    diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    lines.append(f"- {mode}: hierarchical sends {b['link_bytes_per_step'] / a['link_bytes_per_step']:.2f}x fewer "
                 f"bytes over the link than flat rings; its losses differ from theirs by at most {diff:.1e}.")
    if mode + "-mpi" in by_mode:
        m = by_mode[mode + "-mpi"]
        diff = max(abs(x - y) for x, y in zip(a["losses"], m["losses"]))
        lines.append(f"- {mode} on MPI: {m['link_bytes_per_step'] / a['link_bytes_per_step']:.2f}x the link bytes "
                     f"of hierarchical and {m['tokens_per_s'] / a['tokens_per_s']:.2f}x its tokens/s; "
                     f"losses within {diff:.1e} of it.")
lines += ["", "<!-- multinode:end -->"]
benchlib.write_section("BENCHMARKS.md", "<!-- multinode:begin -->", "<!-- multinode:end -->",
                       "\n".join(lines), "bench/multinode.sh")
print("\n".join(lines))
PY
