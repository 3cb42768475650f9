#!/usr/bin/env bash
# Every command's flags go through one parser: a bad value ('5x', 'x'), a
# missing value and an unknown flag each exit 2 with one line on stderr that
# names the flag or word, before any work starts.
#   cli_flags.sh SHARDTRAIN_CLI
set -uo pipefail
cli=$1
err=$(mktemp)
trap 'rm -f "$err"' EXIT
failures=0
# expect WORD ARGS...: exit code 2, exactly one line on stderr, containing WORD.
expect() {
  local word=$1
  shift
  local rc=0
  "$cli" "$@" > /dev/null 2> "$err" < /dev/null || rc=$?
  local lines
  lines=$(wc -l < "$err")
  if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$word" "$err"; then
    echo "FAIL: shardtrain $* exited $rc with $lines lines on stderr (want 2, one line naming '$word'):"
    cat "$err"
    failures=$((failures + 1))
  fi
}
expect "'5x' for --iters" bench-comm --iters 5x
expect "'x' for --iters" bench-comm --iters x
expect "--warmup needs a value" bench-comm --warmup
expect "'5x' for --nproc-per-node" launch --nproc-per-node 5x -- true
expect "--set needs a value" train --set
expect "'--nprocs'" estimate --nprocs 2
expect "'5x' for --threads" tokenize --threads 5x --tokenizer bytes --out o.bin x.txt
expect "'x'" generate --checkpoint none --top-k x
expect "--out needs a value" report run --out
expect "'--verify'" checkpoint list --verify run
expect "--adapter needs a value" lora merge --base b --adapter
expect "'--doc'" config --doc x
[ "$failures" -eq 0 ] || exit 1
echo "cli flags: every bad flag exits 2 with one line"
