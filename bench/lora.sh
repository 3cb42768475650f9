#!/usr/bin/env bash
# LoRA against full fine-tuning on the ~25 M-parameter GPT, 2 ranks (ddp), in
# one run: bytes each rank hands to collectives per step, peak RSS per rank
# and tokens/s for full fine-tuning (fp32), LoRA r=8 on an fp32 base, on an
# int8 base and on an nf4 base (QLoRA). Writes the table into BENCHMARKS.md.
#   make bench-lora   (runs: bash bench/lora.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
cli=build/shardtrain
[ -x "$cli" ] || { echo "build first: make build" >&2; exit 1; }
out=build/bench-lora
rm -rf "$out"
mkdir -p "$out"
steps=${STEPS:-4}
strategy=${STRATEGY:-ddp}
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); nproc: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg)"
for variant in full lora-none lora-int8 lora-nf4; do
  case "$variant" in
    full) lora=(--set lora.r=0) ;;
    lora-*) lora=(--set lora.r=8 --set lora.alpha=16 --set lora.quantize="${variant#lora-}") ;;
  esac
  echo "== $variant"
  "$cli" train configs/default.yaml --nproc-per-node 2 \
    --set distributed.strategy="$strategy" --set distributed.threads_per_rank=1 \
    --set model.n_layer=8 --set model.n_head=8 --set model.n_embd=512 --set model.block_size=256 \
    --set batch.global=2 --set batch.micro=1 --set batch.accumulate=null \
    --set trainer.max_steps="$steps" --set trainer.eval_every=0 --set trainer.sample_tokens=0 \
    --set trainer.progress=plain --set schedule.warmup_steps=1 --set checkpoint.keep=1 \
    --set run.dir="$out/$variant" "${lora[@]}" | tail -1
done
python3 bench/render_lora.py "$out" BENCHMARKS.md \
  --command "make bench-lora   # runs: bash bench/lora.sh (STEPS=$steps STRATEGY=$strategy)" \
  --load "$(cut -d' ' -f1-3 /proc/loadavg)"
