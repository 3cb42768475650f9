#!/usr/bin/env bash
# `shardtrain bench-comm` under the launcher at 3 ranks: every collective on
# an uneven buffer, a single element (two ranks hold nothing) and bf16, and
# all_to_all at 2 ranks; each run prints its line, appends its JSON line and
# checks its own result; a bad option is a one-line error.
#   bench_comm.sh SHARDTRAIN_CLI
set -euo pipefail
cli=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; cat "$dir/out.log" 2>/dev/null; exit 1; }

# Each op on 250 floats (not divisible by 3); reduce_scatter and all_gather,
# whose shards differ by rank, also on one element; all_reduce in bf16, and
# on 75,001 floats of memory from Communicator::allocate (reduced in place).
runs=0
for run in "all_reduce 1001 float32 1000" "reduce_scatter 1001 float32 1000" "all_gather 1001 float32 1000" \
           "broadcast 1001 float32 1000" "reduce_scatter 4 float32 4" "all_gather 4 float32 4" \
           "all_reduce 501 bfloat16 500" "all_reduce 300004 float32 300004 allocated"; do
  set -- $run
  op=$1
  shift
  "$cli" launch --nproc-per-node 3 -- "$cli" bench-comm --op "$op" --bytes "$1" --dtype "$2" \
    --buffer "${4:-ordinary}" --iters 2 --warmup 1 --json "$dir/figures.jsonl" > "$dir/out.log" 2>&1 \
    || fail "bench-comm --op $op --bytes $1 --dtype $2 exited non-zero"
  grep -Eq "^\[rank 0\] $op +$2 +$3 bytes +3 ranks +[0-9.]+ us +algbw +[0-9.]+ GB/s" "$dir/out.log" \
    || fail "no figures line for $op $2 $3 bytes"
  runs=$((runs + 1))
done
# all_to_all at 2 ranks on 251 floats: parts of 125 and 126 (the last takes
# the remainder), so rank 1 receives more than it sends.
"$cli" launch --nproc-per-node 2 -- "$cli" bench-comm --op all_to_all --bytes 1004 --dtype float32 \
  --iters 2 --warmup 1 --json "$dir/figures.jsonl" > "$dir/out.log" 2>&1 \
  || fail "bench-comm --op all_to_all --bytes 1004 exited non-zero"
grep -Eq "^\[rank 0\] all_to_all +float32 +1004 bytes +2 ranks +[0-9.]+ us +algbw +[0-9.]+ GB/s" "$dir/out.log" \
  || fail "no figures line for all_to_all float32 1004 bytes"
runs=$((runs + 1))
lines=$(grep -c '"impl":"shardtrain"' "$dir/figures.jsonl")
[ "$lines" -eq "$runs" ] || fail "$lines JSON lines for $runs runs"
grep -q '"op":"all_reduce","dtype":"bfloat16","bytes":500,"world_size":3,"iters":2' "$dir/figures.jsonl" \
  || fail "the JSON line of all_reduce bf16 lacks its fields"
grep -q '"bytes":300004,.*"buffer":"allocated"' "$dir/figures.jsonl" \
  || fail "the JSON line of all_reduce on allocated memory does not say so"

# Bad options fail while parsing, before any communicator: one process, no launcher.
rc=0
"$cli" bench-comm --op all_to_one > "$dir/out.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "an unknown --op was accepted"
grep -q "all_to_one' is not one of all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, barrier" "$dir/out.log" \
  || fail "the error does not name the bad --op and the choices"
rc=0
"$cli" bench-comm --buffer pinned > "$dir/out.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "an unknown --buffer was accepted"
grep -q "pinned' is not one of ordinary, allocated" "$dir/out.log" || fail "the error does not name the bad --buffer"
echo "bench-comm: $runs runs checked"
