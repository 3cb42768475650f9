#!/usr/bin/env bash
# `shardtrain train` with the default config and a small step cap runs to the
# end on this machine's cores, writes metrics, a checkpoint and the exported
# model, prints a sample and the run directory; `shardtrain generate` then
# reads the run directory.
set -euo pipefail
cli=$1 src=$2
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
cd "$src"
out=$("$cli" train --set trainer.max_steps=4 --set trainer.eval_every=2 \
      --set trainer.eval_batches=2 --set trainer.sample_tokens=32 --set run.dir="$run" 2>&1) || {
  echo "$out"; echo "FAIL: shardtrain train exited non-zero"; exit 1; }
echo "$out"
fail() { echo "FAIL: $*"; exit 1; }
grep -q "run directory: $run" <<<"$out" || fail "no run directory line"
grep -q "sample:" <<<"$out" || fail "no sample printed"
[ -f "$run/metrics.jsonl" ] || fail "no metrics.jsonl"
[ -f "$run/checkpoints/step-000004/COMMITTED" ] || fail "no complete final checkpoint"
[ -f "$run/model.safetensors" ] || fail "no exported model.safetensors"
[ -f "$run/config.yaml" ] || fail "no config.yaml beside the exported model"
[ ! -e "$run/checkpoint" ] || fail "a second checkpoint tree, checkpoint/, was written"
steps=$(grep -c '"loss"' "$run/metrics.jsonl")
evals=$(grep -c '"eval_loss"' "$run/metrics.jsonl")
[ "$steps" -eq 4 ] || fail "expected 4 step lines, got $steps"
[ "$evals" -eq 2 ] || fail "expected 2 evaluation lines, got $evals"
grep -q '"world_size": '"$(nproc)" "$run/metrics.jsonl" || fail "default job did not use $(nproc) ranks"
gen=$("$cli" generate --checkpoint "$run" --prompt "The " --max-new-tokens 16) || fail "generate failed"
[[ "$gen" == The* ]] || fail "generate output does not start with the prompt: $gen"
if "$cli" generate --checkpoint "$run/nowhere" --prompt x 2>/dev/null; then fail "generate accepted a missing checkpoint"; fi
echo "default job OK: $steps steps, $evals evaluations"
