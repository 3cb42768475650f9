#!/usr/bin/env bash
# Tokens/s and peak memory of the ~25 M-parameter GPT for each precision mode,
# with and without activation checkpointing, in one run, one process with
# this machine's cores. Writes the table into BENCHMARKS.md.
#   make bench-precision   (runs: bash bench/precision.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
cli=build/shardtrain
[ -x "$cli" ] || { echo "build first: make build" >&2; exit 1; }
out=build/bench-precision
rm -rf "$out"
mkdir -p "$out"
steps=${STEPS:-3}
batch=${BATCH:-1}  # sequences of 256 tokens per step: bf16 GEMMs run at ~5 GFLOP/s here
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); nproc: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg)"
for precision in fp32 bf16-mixed bf16-true; do
  for ckpt in false true; do
    run="$out/$precision-ckpt-$ckpt"
    echo "== $precision, activation_checkpointing=$ckpt"
    "$cli" train configs/default.yaml --nproc-per-node 1 \
      --set distributed.strategy=single --set precision="$precision" \
      --set model.n_layer=8 --set model.n_head=8 --set model.n_embd=512 --set model.block_size=256 \
      --set model.activation_checkpointing="$ckpt" \
      --set batch.global="$batch" --set batch.micro="$batch" --set batch.accumulate=null \
      --set trainer.max_steps="$steps" --set trainer.eval_every=0 --set trainer.sample_tokens=0 \
      --set trainer.progress=plain --set schedule.warmup_steps=1 --set run.dir="$run" | tail -1
  done
done
python3 bench/render_precision.py "$out" BENCHMARKS.md \
  --command "make bench-precision   # runs: bash bench/precision.sh (STEPS=$steps BATCH=$batch)" --batch "$batch" \
  --load "$(cut -d' ' -f1-3 /proc/loadavg)"
