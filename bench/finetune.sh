#!/usr/bin/env bash
# Fine-tuning benchmarks, written into BENCHMARKS.md between
# <!-- finetune:begin --> and <!-- finetune:end -->:
#   1. `shardtrain generate` tokens/s with the key/value cache against without
#      (every token runs the whole context again), on the llama-25m shape of
#      bench/train.sh (random weights; greedy; a 32-token prompt, 32 and 256
#      new tokens); the load time (a 0-token run) is subtracted.
#   2. Chat fine-tuning (configs/finetune-chat.yaml: QLoRA nf4 under FSDP on 2
#      ranks, data/chat.jsonl in the llama3 template) with packing against
#      without, at block size 512 where the conversations (median 78 tokens)
#      are short: tokens/s of whole rows, and conversations/s, which is what
#      packing buys. Base: a random Llama of configs/llama-base.yaml's shape
#      with the repository's tokenizer.
#   make bench-finetune    (runs: bash bench/finetune.sh; STEPS=20 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
cli=build/shardtrain
[ -x "$cli" ] || { echo "build first: make build" >&2; exit 1; }
py=/usr/bin/python3   # Debian's python3-torch (tests/reference/llama_ref.py writes the bases)
out=build/bench-finetune
rm -rf "$out"
mkdir -p "$out"
steps=${STEPS:-20}
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
unset OPENBLAS_CORETYPE

# ---- generate ------------------------------------------------------------------------
"$py" tests/reference/llama_ref.py make "$out/llama-25m" --num_hidden_layers 8 --hidden_size 512 \
  --num_attention_heads 8 --num_key_value_heads 2 --intermediate_size 1408 --max_position_embeddings 1024 >/dev/null
prompt=$(head -c 2000 data/corpus.txt | tr -s ' \n' ' ' | cut -c1-32)
gen_time() {  # gen_time NEW [--no-cache]: seconds of the best of 3 runs
  local best=
  for _ in 1 2 3; do
    local t0 t1
    t0=$(date +%s.%N)
    "$cli" generate --checkpoint "$out/llama-25m" --prompt "$prompt" --max-new-tokens "$1" --temperature 0 \
      "${@:2}" >/dev/null 2>&1
    t1=$(date +%s.%N)
    best=$(python3 -c "import sys; a=float(sys.argv[1])-float(sys.argv[2]); b=sys.argv[3]; print(a if not b or a < float(b) else b)" "$t1" "$t0" "$best")
  done
  echo "$best"
}
load=$(gen_time 0)
: > "$out/generate.txt"
for n in 32 256; do
  echo "$n $(gen_time "$n") $(gen_time "$n" --no-cache)" >> "$out/generate.txt"
done

# ---- packing -------------------------------------------------------------------------
"$py" tests/reference/llama_ref.py make "$out/base" --vocab_size 2053 --num_hidden_layers 4 --hidden_size 256 \
  --num_attention_heads 8 --num_key_value_heads 2 --intermediate_size 704 --max_position_embeddings 1024 >/dev/null
cp data/tokenizer/tokenizer.json data/tokenizer/tokenizer_config.json "$out/base/"
for packing in true false; do
  "$cli" train configs/finetune-chat.yaml --set model.init_from="$out/base" --set model.block_size=512 \
    --set data.packing=$packing --set trainer.max_steps="$steps" --set trainer.eval_every=0 \
    --set trainer.progress=none --set run.dir="$out/chat-$packing" >"$out/chat-$packing.log" 2>&1 || {
    tail "$out/chat-$packing.log"; exit 1; }
done

python3 - "$out" "$load" "$cpu" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" "$steps" <<'PY'
import json, os, statistics, sys
sys.path.insert(0, "bench")
import benchlib
out, load, cpu, load_before, load_after, steps = sys.argv[1:7]
load = float(load)
lines = ["<!-- finetune:begin -->", "", "## Generation and fine-tuning (CPU, Llama architecture)", "",
         f"`make bench-finetune` (bash bench/finetune.sh) on {cpu}, 2 cores; load average "
         f"{load_before} before, {load_after} after. One thread, OpenBLAS's own kernels.", "",
         "**Generation** (`shardtrain generate`, llama-25m shape: 8 layers, hidden 512, 8 heads over 2 "
         "key/value heads, SwiGLU 1408, vocab 256; greedy after a 32-token prompt; best of 3 runs, "
         f"the model's load time ({load:.2f} s, a 0-token run) subtracted):", "",
         "| new tokens | with KV cache tokens/s | without cache tokens/s | cache speed-up |",
         "|---:|---:|---:|---:|"]
for row in open(os.path.join(out, "generate.txt")):
    n, cached, full = row.split()
    n, c, f = int(n), float(cached) - load, float(full) - load
    lines.append(f"| {n} | {n / c:.0f} | {n / f:.0f} | {f / c:.1f}× |")
lines += ["", "With the cache each new token runs one position through the model; without it, "
          "the whole context again, so the gap grows with the length generated.", "",
          "**Packing** (configs/finetune-chat.yaml: QLoRA nf4, FSDP full_shard on 2 ranks, "
          "data/chat.jsonl in the llama3 template, batch 16 rows of 512 tokens; base of "
          f"configs/llama-base.yaml's shape, random; median step of steps 6-{steps}):", "",
          "| data.packing | rows | packing efficiency | step time s | tokens/s (rows) | conversations/s |",
          "|---|---:|---:|---:|---:|---:|"]
rates = {}
for packing in ("true", "false"):
    steps_ = benchlib.load_jsonl(os.path.join(out, f"chat-{packing}", "metrics.jsonl"), "finetune.sh")
    steps_ = [s for s in steps_ if "step_time_s" in s]
    t = statistics.median(s["step_time_s"] for s in steps_[5:])
    eff = steps_[-1]["packing_efficiency"]
    log = open(os.path.join(out, f"chat-{packing}.log")).read()
    import re
    m = re.search(r"(\d+) training samples in (\d+) rows", log)
    samples, rows = int(m.group(1)), int(m.group(2))
    conv = 16 * samples / rows / t
    rates[packing] = conv
    lines.append(f"| {packing} | {rows} for {samples} conversations | {eff * 100:.1f} % | {t:.2f} | "
                 f"{16 * 512 / t:.0f} | {conv:.1f} |")
lines += ["", f"Packing trains {rates['true'] / rates['false']:.1f}× as many conversations per second: "
          "a row of 512 tokens costs about the same either way (the table's step times), and a packed "
          "one holds several conversations where an unpacked one holds one and padding.",
          "", "<!-- finetune:end -->"]
benchlib.write_section("BENCHMARKS.md", "<!-- finetune:begin -->", "<!-- finetune:end -->", "\n".join(lines),
                       "finetune.sh")
print("\n".join(lines))
PY
