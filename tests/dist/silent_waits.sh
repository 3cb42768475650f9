#!/usr/bin/env bash
# Waits that say what they wait for:
#   - a rank whose peer never starts prints who is missing about every 10 s
#     and fails at SHARDTRAIN_TIMEOUT_S naming that rank;
#   - a rank stopped with SIGSTOP mid-run is named as the suspect, both in
#     the error of the healthy rank that timed out on it and in the
#     launcher's summary, which otherwise blames the healthy rank.
set -euo pipefail
cli=$1 src=$2
cd "$src"
work=$(mktemp -d)
trap 'pkill -9 -P $$ 2>/dev/null || true; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
common=(--set trainer.eval_every=0 --set trainer.sample_tokens=0
        --set batch.global=4 --set batch.micro=2 --set batch.accumulate=null
        --set model.n_layer=1 --set model.n_embd=32 --set model.block_size=32
        --set distributed.strategy=ddp --set distributed.threads_per_rank=1)

# Rank 0 of 2, started by hand; rank 1 never comes.
port=$("$cli" launch --nproc-per-node 1 -- sh -c 'echo $MASTER_PORT' | sed 's/.*] //')
rc=0
RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port SHARDTRAIN_TIMEOUT_S=13 \
  "$cli" train "${common[@]}" --set trainer.max_steps=2 --set run.dir="$work/alone" \
  >"$work/alone.log" 2>&1 || rc=$?
[ "$rc" != 0 ] || fail "rank 0 succeeded without its peer"
grep -q "rank 0 waiting for rank 1 of 2 to join (1[0-9] s of 13 s)" "$work/alone.log" ||
  { cat "$work/alone.log"; fail "no 'waiting for rank 1' line"; }
grep -q "rank 1 of 2 never joined the rendezvous" "$work/alone.log" ||
  { cat "$work/alone.log"; fail "the timeout does not name the missing rank"; }
echo "missing peer OK: named while waiting and in the error"

# Two ranks; rank 1 is stopped after step 2.
SHARDTRAIN_TIMEOUT_S=6 "$cli" train "${common[@]}" --nproc-per-node 2 \
  --set trainer.max_steps=100000 --set run.dir="$work/hung" >"$work/hung.log" 2>&1 &
launcher=$!
until grep -q '"step": 2,' "$work/hung/metrics.jsonl" 2>/dev/null; do
  kill -0 "$launcher" 2>/dev/null || { cat "$work/hung.log"; fail "the run ended early"; }
  sleep 0.05
done
ranks=($(pgrep -P "$launcher" -x shardtrain))  # not the fork server
[ "${#ranks[@]}" -eq 2 ] || fail "expected 2 ranks, found ${#ranks[@]}"
# Rank 1 is the one started second: the larger pid (the launcher starts its
# ranks in order, and a forked rank's /proc/PID/environ is the launcher's).
stopped=$(printf '%s\n' "${ranks[@]}" | sort -n | tail -n 1)
kill -STOP "$stopped"
echo "SIGSTOP to rank 1 (pid $stopped)"
rc=0
wait "$launcher" || rc=$?
[ "$rc" != 0 ] || fail "the launcher exited 0"
grep -q "Suspect: rank 1 (no heartbeat for" "$work/hung.log" ||
  { cat "$work/hung.log"; fail "rank 0's timeout does not name rank 1 as the suspect"; }
grep -q "shardtrain launch: rank 0 failed .*; suspect: rank 1 (no heartbeat" "$work/hung.log" ||
  { cat "$work/hung.log"; fail "the launcher's summary does not name rank 1 as the suspect"; }
grep -q "suspect: rank 1 .*rank 0's failure is probably a consequence" "$work/hung.log" ||
  { cat "$work/hung.log"; fail "the launcher's report does not put the blame on rank 1"; }
echo "hung rank OK: rank 1 named as the suspect"
