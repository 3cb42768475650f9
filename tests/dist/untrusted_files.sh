#!/usr/bin/env bash
# Files that are not regular files, given to the CLI where it reads one: a
# FIFO, /dev/zero and a directory as data.train, as `tokenize` INPUT, as a
# model directory's config.json and as a safetensors shard. Each is refused
# at once (exit 2 for data and configs, 3 for model weights) with one line
# that names the file and says what it is; `timeout` turns a regression
# (a read that waits on the FIFO or never ends) into a failure, and the
# address-space limit keeps a read of /dev/zero from filling the machine.
#   untrusted_files.sh SHARDTRAIN_CLI
set -uo pipefail
cli=$(realpath "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export SHARDTRAIN_TIMEOUT_S=30 OMP_NUM_THREADS=1
ulimit -v 16000000  # KiB: far above what refusing needs, far below the machine
failures=0

# expect RC WORDS... -- COMMAND...: exits RC within 20 s, stderr's last line
# holding every WORD.
expect() {
  local want=$1
  shift
  local words=()
  while [ "$1" != "--" ]; do words+=("$1"); shift; done
  shift
  local rc=0
  timeout -k 5 20 "$cli" "$@" > out.txt 2> err.txt < /dev/null || rc=$?
  local last
  last=$(tail -n 1 err.txt)
  local ok=1
  [ "$rc" -eq "$want" ] || ok=0
  for w in "${words[@]}"; do grep -qF -- "$w" <<<"$last" || ok=0; done
  if [ "$ok" -ne 1 ]; then
    echo "FAIL: shardtrain $* exited $rc (want $want; 124 is the timeout), last line of stderr:"
    echo "  $last"
    echo "  wanted it to hold: ${words[*]}"
    failures=$((failures + 1))
  fi
}

fifo="is a FIFO (named pipe), not a regular file"
dev="is a character device, not a regular file"
dir="is a directory, not a regular file"
mkfifo pipe.jsonl pipe.txt
ln -s /dev/zero zero.jsonl
mkdir folder
printf 'hello world\n' > doc.txt

# data.train: JSON lines and text, 1 rank (the refusal comes before any model).
train=(train --nproc-per-node 1 --set trainer.max_steps=1)
expect 2 "$work/pipe.jsonl" "$fifo" -- "${train[@]}" --set data.train="$work/pipe.jsonl" --set run.dir="$work/r1"
expect 2 "$work/pipe.txt" "$fifo" -- "${train[@]}" --set data.train="$work/pipe.txt" --set run.dir="$work/r2"
expect 2 "$work/zero.jsonl" "$dev" -- "${train[@]}" --set data.train="$work/zero.jsonl" --set run.dir="$work/r3"

# tokenize INPUT: a FIFO, /dev/zero, a directory (alone and beside a good file).
tok=(tokenize --tokenizer bytes --quiet --out "$work/out.bin")
expect 2 "pipe.txt" "$fifo" -- "${tok[@]}" pipe.txt
expect 2 "pipe.jsonl" "$fifo" -- "${tok[@]}" pipe.jsonl
expect 2 "/dev/zero" "$dev" -- "${tok[@]}" /dev/zero
expect 2 "folder" "$dir" -- "${tok[@]}" folder
expect 2 "folder" "$dir" -- "${tok[@]}" doc.txt folder
[ ! -e out.bin ] || { echo "FAIL: tokenize wrote --out although an INPUT was refused"; failures=$((failures + 1)); }

# A model directory: config.json as /dev/zero and as a FIFO (not "absent"),
# and a shard named by the index that is a FIFO (not "missing"). `generate`
# reads config.json as `train` does (model.init_from, resolve_model_config).
mkdir zero-config pipe-config pipe-shard
ln -s /dev/zero zero-config/config.json
mkfifo pipe-config/config.json
cat > pipe-shard/config.json <<'JSON'
{"model_type": "llama", "vocab_size": 256, "hidden_size": 16, "num_hidden_layers": 1,
 "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64}
JSON
echo '{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}' \
  > pipe-shard/model.safetensors.index.json
mkfifo pipe-shard/model-00001-of-00001.safetensors
gen=(generate --prompt hi --max-new-tokens 1)
expect 2 "zero-config/config.json" "$dev" -- "${gen[@]}" --checkpoint "$work/zero-config"
expect 2 "pipe-config/config.json" "$fifo" -- "${gen[@]}" --checkpoint "$work/pipe-config"
expect 3 "model-00001-of-00001.safetensors" "$fifo" -- "${gen[@]}" --checkpoint "$work/pipe-shard"

[ "$failures" -eq 0 ] || exit 1
echo "untrusted files: every FIFO, device and directory refused at once, named"
