#!/usr/bin/env bash
# Elastic restarts that resume exactly: a 2-rank ddp run with a checkpoint
# every 2 steps loses a random rank to SIGKILL at a random step three times;
# under --max-restarts 3 it finishes, every restart resumes from the newest
# checkpoint (restart count in the metrics, "resumed from step" in the log),
# and its final parameters are bit-identical to an uninterrupted run's. Then
# a damaged newest checkpoint makes resume fall back to the previous one.
set -euo pipefail
cli=$1 src=$2
shift 2
extra=("$@")  # more --set options: the same test under another layout (a pipeline)
cd "$src"
work=$(mktemp -d)
trap 'pkill -9 -P $$ 2>/dev/null || true; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
common=(--set trainer.max_steps=30 --set trainer.eval_every=0 --set trainer.sample_tokens=0
        --set batch.global=8 --set batch.micro=2 --set batch.accumulate=null
        --set model.n_layer=2 --set model.n_embd=64 --set model.block_size=64
        --set checkpoint.every_n_steps=2 --set distributed.strategy=ddp
        ${extra[@]+"${extra[@]}"})

"$cli" train "${common[@]}" --nproc-per-node 2 --set run.dir="$work/clean" >"$work/clean.log" 2>&1 ||
  { cat "$work/clean.log"; fail "the uninterrupted run failed"; }

# The newest metrics line of the current attempt: "<restarts> <step>", or "".
latest() {
  [ -f "$work/chaos/metrics.jsonl" ] || return 0
  tail -n 1 "$work/chaos/metrics.jsonl" |
    sed -n 's/.*"step": *\([0-9]*\).*"restarts": *\([0-9]*\).*/\2 \1/p;s/.*"restarts": *\([0-9]*\).*"step": *\([0-9]*\).*/\1 \2/p' | head -n 1
}

"$cli" train "${common[@]}" --nproc-per-node 2 --max-restarts 3 --set run.dir="$work/chaos" \
  >"$work/chaos.log" 2>&1 &
launcher=$!
for k in 0 1 2; do
  target=$((3 + 9 * k + RANDOM % 6))  # one step in 3..8, 12..17, 21..26
  until read -r r s <<<"$(latest)" && [ "${r:-}" = "$k" ] && [ "${s:-0}" -ge "$target" ]; do
    kill -0 "$launcher" 2>/dev/null || { cat "$work/chaos.log"; fail "the run ended before kill $((k + 1))"; }
    sleep 0.02
  done
  ranks=($(pgrep -P "$launcher" -x shardtrain))  # not the fork server
  [ "${#ranks[@]}" -eq 2 ] || fail "expected 2 ranks under the launcher, found ${#ranks[@]}"
  victim=${ranks[$((RANDOM % 2))]}
  echo "kill $((k + 1)): SIGKILL to rank pid $victim at step $s"
  kill -9 "$victim"
done
rc=0
wait "$launcher" || rc=$?
[ "$rc" = 0 ] || { cat "$work/chaos.log"; fail "the interrupted run exited $rc"; }
restarts=$(grep -c "restarting all 2 ranks" "$work/chaos.log" || true)
[ "$restarts" = 3 ] || { cat "$work/chaos.log"; fail "expected 3 restarts, saw $restarts"; }
for k in 1 2 3; do
  grep -q "resumed from step [0-9]* after restart $k" "$work/chaos.log" ||
    { cat "$work/chaos.log"; fail "restart $k did not say it resumed"; }
done
cmp "$work/clean/model.safetensors" "$work/chaos/model.safetensors" ||
  fail "final parameters differ from the uninterrupted run"
echo "chaos OK: 3 kills, 3 restarts, bit-identical final model"

# A damaged newest checkpoint: resume falls back to the previous complete one,
# names the damaged file, and retraining the lost steps gives the same model.
cp "$work/clean/model.safetensors" "$work/expected.safetensors"
file="$work/clean/checkpoints/step-000030/rank-00001.bin"
size=$(stat -c %s "$file")
printf '\xff\x00\xff\x00' | dd of="$file" bs=1 seek=$((size / 2)) conv=notrunc status=none
"$cli" train "${common[@]}" --nproc-per-node 2 --set checkpoint.resume=auto \
  --set run.dir="$work/clean" >"$work/fallback.log" 2>&1 || { cat "$work/fallback.log"; fail "resume with a damaged checkpoint failed"; }
grep -q "cannot resume from .*step-000030.*rank-00001.bin.*falling back" "$work/fallback.log" ||
  { cat "$work/fallback.log"; fail "the damaged checkpoint was not named in a warning"; }
cmp "$work/expected.safetensors" "$work/clean/model.safetensors" ||
  fail "the model retrained from the previous checkpoint differs"
echo "fallback OK: damaged step 30 named and skipped, same final model from the previous checkpoint"
