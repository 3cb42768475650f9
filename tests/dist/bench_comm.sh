#!/usr/bin/env bash
# `shardtrain bench-comm` under the launcher at 3 ranks: every collective, an
# uneven buffer (250 floats) and a single element (two ranks hold nothing),
# fp32 and bf16; each run prints its line, appends its JSON line and checks
# its own result; a bad option is a one-line error.
#   bench_comm.sh SHARDTRAIN_CLI
set -euo pipefail
cli=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; cat "$dir/out.log" 2>/dev/null; exit 1; }

runs=0
for op in all_reduce reduce_scatter all_gather broadcast; do
  for case in "1001 float32 1000" "4 float32 4" "501 bfloat16 500"; do
    set -- $case
    "$cli" launch --nproc-per-node 3 -- "$cli" bench-comm --op "$op" --bytes "$1" --dtype "$2" \
      --iters 2 --warmup 1 --json "$dir/figures.jsonl" > "$dir/out.log" 2>&1 \
      || fail "bench-comm --op $op --bytes $1 --dtype $2 exited non-zero"
    grep -Eq "^\[rank 0\] $op +$2 +$3 bytes +3 ranks +[0-9.]+ us +algbw +[0-9.]+ GB/s" "$dir/out.log" \
      || fail "no figures line for $op $2 $3 bytes"
    runs=$((runs + 1))
  done
done
lines=$(grep -c '"impl":"shardtrain"' "$dir/figures.jsonl")
[ "$lines" -eq "$runs" ] || fail "$lines JSON lines for $runs runs"
grep -q '"op":"reduce_scatter","dtype":"bfloat16","bytes":500,"world_size":3,"iters":2' "$dir/figures.jsonl" \
  || fail "the JSON line of reduce_scatter bf16 lacks its fields"

rc=0
"$cli" launch --nproc-per-node 2 -- "$cli" bench-comm --op all_to_all > "$dir/out.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "an unknown --op was accepted"
grep -q "all_to_all' is not one of all_reduce, reduce_scatter, all_gather, broadcast" "$dir/out.log" \
  || fail "the error does not name the bad --op and the choices"
echo "bench-comm: $runs runs checked"
