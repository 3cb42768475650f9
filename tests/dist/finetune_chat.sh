#!/usr/bin/env bash
# The fine-tuning tour end to end (configs/llama-base.yaml, then
# configs/finetune-chat.yaml), shortened: a small Llama pretrained with the
# repository's tokenizer is exported as a Hugging Face directory (config.json,
# weights, tokenizer files); QLoRA (nf4) under FSDP on 2 ranks fine-tunes it
# on data/chat.jsonl with the llama3 template recognised from that
# directory, prompts masked and conversations packed; the evaluation loss on
# the held-out answers falls; `generate --chat` answers through the same
# template from the exported model and from the run's checkpoint.
set -euo pipefail
cli=$1 src=$2
cd "$src"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export SHARDTRAIN_TIMEOUT_S=120 OMP_NUM_THREADS=1

small=(--set model.n_layer=2 --set model.n_embd=64 --set model.n_head=4 --set model.n_kv_head=2
       --set model.intermediate_size=192)
out=$("$cli" train configs/llama-base.yaml "${small[@]}" --set trainer.max_steps=30 --set trainer.eval_every=0 \
      --set trainer.sample_tokens=8 --set run.dir="$work/base" --nproc-per-node 2 2>&1) || {
  echo "$out" | tail -20; fail "pretraining the base exited non-zero"; }
grep -q "sample:" <<<"$out" || fail "the base run printed no sample through its tokenizer"
for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do
  [ -f "$work/base/model/$f" ] || fail "the exported base lacks $f"
done
grep -q '"model_type": "llama"' "$work/base/model/config.json" || fail "config.json does not say llama"

out=$("$cli" train configs/finetune-chat.yaml --set model.init_from="$work/base/model" \
      --set trainer.max_steps=30 --set trainer.eval_every=10 --set run.dir="$work/chat" 2>&1) || {
  echo "$out" | tail -20; fail "fine-tuning exited non-zero"; }
grep -q "data: jsonl, .* packing efficiency" <<<"$out" || { echo "$out" | head; fail "no data line"; }
grep -q "strategy fsdp" <<<"$out" || fail "fine-tuning did not run under fsdp"
python3 - "$work/chat" <<'PY' || exit 1
import json, os, sys
run = sys.argv[1]
evals = [json.loads(l)["eval_loss"] for l in open(os.path.join(run, "metrics.jsonl")) if '"eval_loss"' in l]
print("eval losses:", " ".join(f"{e:.4f}" for e in evals))
if len(evals) != 3 or not all(b < a for a, b in zip(evals, evals[1:])):
    sys.exit("FAIL: the evaluation loss on held-out answers does not fall at every evaluation")
cfg = json.load(open(os.path.join(run, "adapter", "adapter_config.json")))
want = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
if set(cfg["target_modules"]) != want or cfg["task_type"] != "CAUSAL_LM" or cfg["fan_in_fan_out"]:
    sys.exit(f"FAIL: adapter_config.json {cfg}")
PY
for f in config.json tokenizer.json tokenizer_config.json; do
  [ -f "$work/chat/model/$f" ] || fail "the merged export lacks $f"
done
for from in "$work/chat/model" "$work/chat"; do
  reply=$("$cli" generate --checkpoint "$from" --chat --prompt 'What does "kluge" mean?' \
          --temperature 0 --max-new-tokens 12 2>/dev/null) || fail "generate --chat from $from exited non-zero"
  [ -n "$reply" ] || fail "generate --chat from $from printed nothing"
done
echo "fine-tuning tour OK"
