#!/usr/bin/env bash
# Loading a Hugging Face directory under FSDP FULL_SHARD on 2 ranks, written
# into BENCHMARKS.md between <!-- loading:begin --> and <!-- loading:end -->.
# The program is the loading test (tests/dist/test_sharded_loading.cpp) on a
# larger random Llama (LAYERS x HIDDEN, SwiGLU INTERMEDIATE, 4 kv heads; by
# default 16 x 1024 x 2816, 0.73 GB of fp32 weights in two shards), once
# fully fine-tuned and once as a QLoRA nf4 base. Per variant: the seconds
# from make_task to a set-up trainer (the slower rank) against reading the
# files once (warm page cache, rank 0) into one reused buffer and into new
# memory of each file's size, and each rank's peak RSS while loading
# against its peak over two training steps.
#   make bench-loading      (runs: bash bench/loading.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
cli=$build/shardtrain
prog=$build/tests/test_sharded_loading
[ -x "$cli" ] && [ -x "$prog" ] || { echo "build first: make build" >&2; exit 1; }
out=$build/bench-loading
rm -rf "$out"
mkdir -p "$out"
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
export OMP_NUM_THREADS=1 SHARDTRAIN_TIMEOUT_S=600
export SHARDTRAIN_LLAMA_REF=$PWD/tests/reference/llama_ref.py
export SHARDTRAIN_LOADING_LAYERS=${LAYERS:-16} SHARDTRAIN_LOADING_HIDDEN=${HIDDEN:-1024}
export SHARDTRAIN_LOADING_INTERMEDIATE=${INTERMEDIATE:-2816}
unset OPENBLAS_CORETYPE
for q in none nf4; do
  SHARDTRAIN_LOADING_QUANTIZE=$q "$cli" launch --nproc-per-node 2 -- "$prog" > "$out/$q.log" 2>&1 ||
    { cat "$out/$q.log" >&2; exit 1; }
  grep -o 'loading: .*' "$out/$q.log" | head -1 > "$out/$q.txt"
done

python3 - "$out" "$cpu" <<'PY'
import os, sys
sys.path.insert(0, "bench")
import benchlib
out, cpu = sys.argv[1], sys.argv[2]
rows = {}
for q in ("none", "nf4"):
    text = open(os.path.join(out, q + ".txt")).read().split()[1:]
    rows[q] = {k: v for k, v in (kv.split("=") for kv in text)}
r0 = rows["none"]
layers, hidden, inter = (os.environ[f"SHARDTRAIN_LOADING_{k}"] for k in ("LAYERS", "HIDDEN", "INTERMEDIATE"))
lines = ["<!-- loading:begin -->", "", "## Loading a Hugging Face directory under FULL_SHARD", "",
         f"`make bench-loading` (bench/loading.sh) on {cpu}; 2 ranks, one thread each. A random Llama of "
         f"{layers} layers, hidden {hidden}, SwiGLU {inter}, 4 kv heads: {float(r0['model_mb']):.0f} MB of fp32 "
         "weights in two safetensors shards. Load: from make_task to a set-up trainer (model built deferred, "
         "each rank reading only its shards' byte ranges), the slower rank. Peaks: each rank's VmHWM, the "
         "larger of the two.", "",
         "| run | load s | read once, reused buffer s | read once, new memory s | load / read (new memory) | "
         "RSS growth while loading MB | loading peak MB | training peak MB |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
for q, name in (("none", "full fine-tuning, fp32"), ("nf4", "QLoRA nf4 base")):
    r = rows[q]
    load, read, fresh = float(r["load_s"]), float(r["read_once_s"]), float(r["read_fresh_s"])
    lines.append(f"| {name} | {load:.2f} | {read:.2f} | {fresh:.2f} | {load / fresh:.2f}× | "
                 f"{float(r['load_growth_mb']):.0f} | {float(r['load_peak_mb']):.0f} | {float(r['train_peak_mb']):.0f} |")
lines += ["", "<!-- loading:end -->"]
benchlib.write_section("BENCHMARKS.md", "<!-- loading:begin -->", "<!-- loading:end -->", "\n".join(lines),
                       "loading.sh")
print("\n".join(lines))
PY
