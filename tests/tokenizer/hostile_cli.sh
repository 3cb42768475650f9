#!/usr/bin/env bash
# `shardtrain tokenize` with hostile tokenizer.json files: each exits 2 with
# one line on stderr naming tokenizer.json and the entry, where a negative id
# was a SIGSEGV (rc 139) and an expanding normalizer an OOM kill.
#   hostile_cli.sh SHARDTRAIN_CLI
set -uo pipefail
cli=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0
printf 'abc abc\n' > "$dir/x.txt"

# tokenizer NAME MODEL_VOCAB [NORMALIZER]: a BPE tokenizer.json in DIR/NAME/.
tokenizer() {
  mkdir -p "$dir/$1"
  printf '{"normalizer": %s, "pre_tokenizer": null, "post_processor": null, "decoder": null, "added_tokens": [],
 "model": {"type": "BPE", "vocab": %s, "merges": []}}\n' "${3:-null}" "$2" > "$dir/$1/tokenizer.json"
}
# expect NAME WORD...: exit 2, one line on stderr, holding every WORD.
expect() {
  local name=$1
  shift
  local rc=0
  timeout 60 "$cli" tokenize --quiet --tokenizer "$dir/$name/tokenizer.json" --out "$dir/$name.bin" "$dir/x.txt" \
    > /dev/null 2> "$dir/err" < /dev/null || rc=$?
  local lines ok=1
  lines=$(wc -l < "$dir/err")
  for word in "$@"; do grep -qF -- "$word" "$dir/err" || ok=0; done
  if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || [ "$ok" -ne 1 ]; then
    echo "FAIL: $name: exited $rc with $lines lines on stderr (want 2, one line naming: $*):"
    cat "$dir/err"
    failures=$((failures + 1))
  fi
}

tokenizer negative '{"a": 0, "b": 1, "c": -5, " ": 3}'
expect negative "configuration error" "tokenizer.json" "model.vocab 'c'" "-5"
tokenizer huge '{"a": 0, "b": 1, "c": 2147483647, " ": 3}'
expect huge "tokenizer.json" "model.vocab 'c'" "2147483647"
tokenizer holes '{"a": 0, "b": 1, "c": 300000000, " ": 3}'
expect holes "tokenizer.json" "model.vocab 'c'" "300000000"
tokenizer empty '{}'
expect empty "tokenizer.json" "model.vocab holds no token"
# "a" to 100,000 characters: 8 bytes of input may grow to 16 * 8 + 4096 bytes.
long=$(head -c 100000 /dev/zero | tr '\0' 'b')
tokenizer expands '{"a": 0, "b": 1, "c": 2, " ": 3}' \
  "{\"type\": \"Replace\", \"pattern\": {\"String\": \"a\"}, \"content\": \"$long\"}"
expect expands "tokenizer.json" "normalizer Replace of \"a\"" "4224 bytes"

# The same file without the hostile entry works (the test's files are sound).
tokenizer sound '{"a": 0, "b": 1, "c": 2, " ": 3}'
if ! "$cli" tokenize --quiet --tokenizer "$dir/sound/tokenizer.json" --out "$dir/sound.bin" "$dir/x.txt" 2> "$dir/err"; then
  echo "FAIL: the sound tokenizer.json was refused:"
  cat "$dir/err"
  failures=$((failures + 1))
fi
[ "$failures" -eq 0 ] || exit 1
echo "hostile tokenizer.json: every case exits 2 with one line"
