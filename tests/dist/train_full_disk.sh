#!/usr/bin/env bash
# A disk that fills up at the end of `shardtrain train`: the run directory is
# on a small tmpfs this test mounts (and unmounts), sized from a reference run.
#   A. 2 ranks; the final sharded checkpoint does not fit: exit 3 with a
#      one-line checkpoint error, the previous checkpoint complete (inspect
#      verifies it), no temporary directory or file, metrics.jsonl whole lines.
#   B. 1 rank; the final checkpoint fits but the model export does not: the
#      checkpoint was written first and is complete, exit 3, no half model.
#   C. `shardtrain tokenize --out` on a full disk: exit 3, the old token file
#      intact; --out a FIFO refused; links planted at OUT.tmp and OUT.
# Needs root to mount (CI runs as root); exits 77 (skipped) otherwise.
# KEEP_LOGS=DIR copies the runs' logs there.
#   train_full_disk.sh SHARDTRAIN_CLI SOURCE_DIR
set -euo pipefail
cli=$1 src=$2
if [ "$(id -u)" -ne 0 ]; then echo "SKIP: mounting a tmpfs needs root"; exit 77; fi
work=$(mktemp -d)
disk="$work/disk"
mkdir -p "$disk"
cleanup() {
  if mountpoint -q "$disk"; then umount "$disk"; fi
  rm -rf "$work"
}
trap cleanup EXIT
[ -n "${KEEP_LOGS:-}" ] && trap 'cp "$work"/*.log "$KEEP_LOGS"/ 2>/dev/null; cleanup' EXIT
fail() { echo "FAIL: $*"; exit 1; }

common=(--set data.train="$src/data/corpus.txt" --set data.val_fraction=0
  --set trainer.progress=plain --set trainer.sample_tokens=0 --set trainer.eval_every=0
  --set model.n_layer=2 --set model.n_head=2 --set model.n_embd=64 --set model.block_size=32
  --set batch.global=4 --set batch.micro=2 --set batch.accumulate=null
  --set distributed.threads_per_rank=1)

# Reference sizes (KiB on disk) of one checkpoint and of the exported model.
"$cli" train "$src/configs/default.yaml" "${common[@]}" --nproc-per-node 1 \
  --set distributed.strategy=single --set run.dir="$work/ref" --set trainer.max_steps=1 \
  > "$work/ref.log" 2>&1 || { cat "$work/ref.log"; fail "reference run"; }
ckpt_kb=$(du -sk "$work/ref/checkpoints/step-000001" | cut -f1)
model_kb=$(du -sk "$work/ref/model.safetensors" | cut -f1)
echo "one checkpoint: ${ckpt_kb} KiB, exported model: ${model_kb} KiB"
[ "$model_kb" -gt 200 ] || fail "the model is too small for the margins of this test"

# Mounts a fresh tmpfs of $1 KiB on $disk.
remount() {
  if mountpoint -q "$disk"; then umount "$disk"; fi
  mount -t tmpfs -o size="$1k" shardtrain-full-disk "$disk"
}
# No temporary directory or file anywhere in the run directory.
no_temporaries() {
  local left
  left=$(find "$1" \( -name '*.tmp' -o -name '*.tmp-*' -o -name '*.tmp.*' -o -name '*.old' \) -print)
  [ -z "$left" ] || fail "temporary files left behind: $left"
}
# Every line of metrics.jsonl is whole JSON; $2 step lines.
whole_metrics() {
  python3 - "$1/metrics.jsonl" "$2" <<'EOF'
import json, sys
data = open(sys.argv[1], "rb").read()
assert data.endswith(b"\n"), "metrics.jsonl ends in the middle of a line"
lines = data.decode().splitlines()
for line in lines:
    json.loads(line)
steps = sum(1 for line in lines if '"loss"' in line)
assert steps == int(sys.argv[2]), f"{steps} step lines, expected {sys.argv[2]}"
EOF
}
# One line for the error, no LibTorch backtrace, no abort.
one_line_error() {
  grep -q "$2" "$1" || { cat "$1"; fail "no '$2' in the output"; }
  if grep -qE "terminate called|Exception raised from|frame #" "$1"; then
    cat "$1"; fail "a raw error or backtrace reached the user"
  fi
}

# ---- A: the final checkpoint does not fit ----
remount $((ckpt_kb + ckpt_kb / 2 + 64))
rc=0
"$cli" train "$src/configs/default.yaml" "${common[@]}" --nproc-per-node 2 \
  --set distributed.strategy=ddp --set run.dir="$disk/run" --set trainer.max_steps=3 \
  --set checkpoint.every_n_steps=2 > "$work/a.log" 2>&1 || rc=$?
[ "$rc" -eq 3 ] || { cat "$work/a.log"; fail "A: exit code $rc, expected 3"; }
one_line_error "$work/a.log" "checkpoint error: .*No space left on device"
[ -f "$disk/run/checkpoints/step-000002/COMMITTED" ] || { ls -R "$disk/run"; fail "A: the previous checkpoint is gone"; }
[ ! -e "$disk/run/checkpoints/step-000003" ] || fail "A: a torn step-000003 was left"
"$cli" checkpoint inspect "$disk/run/checkpoints/step-000002" > "$work/a_inspect.log" 2>&1 ||
  { cat "$work/a_inspect.log"; fail "A: the previous checkpoint does not verify"; }
no_temporaries "$disk/run"
whole_metrics "$disk/run" 3
[ ! -e "$disk/run/model.safetensors" ] || fail "A: a model was exported after the final save failed"
echo "A: final save on a full disk: exit 3, step 2 intact, nothing torn"

# ---- B: the final checkpoint fits, the export does not ----
remount $((ckpt_kb + model_kb / 2 + 64))
rc=0
"$cli" train "$src/configs/default.yaml" "${common[@]}" --nproc-per-node 1 \
  --set distributed.strategy=single --set run.dir="$disk/run" --set trainer.max_steps=2 \
  --set checkpoint.every_n_steps=0 > "$work/b.log" 2>&1 || rc=$?
[ "$rc" -eq 3 ] || { cat "$work/b.log"; fail "B: exit code $rc, expected 3"; }
one_line_error "$work/b.log" "exporting the model"
[ -f "$disk/run/checkpoints/step-000002/COMMITTED" ] ||
  { ls -R "$disk/run"; fail "B: the final checkpoint was not written before the export"; }
"$cli" checkpoint inspect "$disk/run" > "$work/b_inspect.log" 2>&1 ||
  { cat "$work/b_inspect.log"; fail "B: the final checkpoint does not verify"; }
no_temporaries "$disk/run"
whole_metrics "$disk/run" 2
[ ! -e "$disk/run/model.safetensors" ] || fail "B: a model file is there after its export failed"
echo "B: export on a full disk: exit 3, the final checkpoint complete, no half model"

# ---- C: `shardtrain tokenize --out` (issue 47, item 4) ----
# The token file is written as every output is: a new temporary beside it
# (O_EXCL | O_NOFOLLOW), renamed over it. On a full disk: exit 3, the old
# file byte for byte, no temporary. A FIFO as --out is refused at once (it
# used to hang); links planted at OUT.tmp and OUT are never written through.
head -c 20000 "$src/data/corpus.txt" > "$work/small.txt"
for i in 1 2 3 4 5 6 7 8; do cat "$src/data/corpus.txt"; done > "$work/big.txt"
remount 1024
"$cli" tokenize --tokenizer bytes --quiet --out "$disk/train.bin" "$work/small.txt" > "$work/c0.log" 2>&1 ||
  { cat "$work/c0.log"; fail "C: tokenizing the small file"; }
before=$(sha256sum < "$disk/train.bin")
rc=0
"$cli" tokenize --tokenizer bytes --quiet --out "$disk/train.bin" "$work/big.txt" > "$work/c.log" 2>&1 || rc=$?
[ "$rc" -eq 3 ] || { cat "$work/c.log"; fail "C: exit code $rc on a full disk, expected 3"; }
one_line_error "$work/c.log" "train.bin"
[ "$(sha256sum < "$disk/train.bin")" = "$before" ] || fail "C: the old token file was damaged"
no_temporaries "$disk"
mkfifo "$work/out.fifo"
rc=0
timeout 20 "$cli" tokenize --tokenizer bytes --quiet --out "$work/out.fifo" "$work/small.txt" > "$work/c1.log" 2>&1 || rc=$?
[ "$rc" -eq 2 ] || { cat "$work/c1.log"; fail "C: --out a FIFO: exit code $rc, expected 2"; }
one_line_error "$work/c1.log" "is a FIFO (named pipe), not a regular file"
[ -p "$work/out.fifo" ] || fail "C: the FIFO was replaced"
echo precious > "$work/victim" && echo precious > "$work/victim2"
ln -s "$work/victim" "$work/linked.bin.tmp" && ln -s "$work/victim2" "$work/linked.bin"
"$cli" tokenize --tokenizer bytes --quiet --out "$work/linked.bin" "$work/small.txt" > "$work/c2.log" 2>&1 ||
  { cat "$work/c2.log"; fail "C: tokenizing to a planted link"; }
[ "$(cat "$work/victim")" = precious ] && [ "$(cat "$work/victim2")" = precious ] ||
  fail "C: a file behind a planted link was written through"
[ -f "$work/linked.bin" ] && [ ! -L "$work/linked.bin" ] || fail "C: --out is still the planted link"
cmp -s "$work/linked.bin" "$disk/train.bin" || fail "C: the token file differs from the same input's on the tmpfs"
echo "C: tokenize --out: full disk exit 3 with the old file intact; a FIFO refused; planted links not followed"
