#!/usr/bin/env bash
# SIGTERM during `shardtrain train` on 2 ranks: every rank finishes its step,
# a complete checkpoint is written and the command exits 143; a second run
# with checkpoint.resume=auto continues from that step, and a hangup (SIGHUP,
# twice, as a closing terminal sends it) stops it the same way, exit 129; a
# third run continues from there and finishes.
#   train_signal.sh SHARDTRAIN_CLI SOURCE_DIR
set -euo pipefail
cli=$1 src=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=(--nproc-per-node 2
  --set run.dir="$dir/run" --set data.train="$src/data/corpus.txt"
  --set trainer.progress=none --set trainer.sample_tokens=0 --set trainer.eval_every=0
  --set model.n_layer=1 --set model.n_head=2 --set model.n_embd=32 --set model.block_size=32
  --set batch.global=8 --set batch.micro=2 --set batch.accumulate=null
  --set distributed.strategy=fsdp --set distributed.threads_per_rank=1)

"$cli" train "$src/configs/default.yaml" "${common[@]}" --set trainer.max_steps=1000000 \
  > "$dir/first.log" 2>&1 &
pid=$!
for _ in $(seq 1 1200); do
  [ "$(wc -l < "$dir/run/metrics.jsonl" 2>/dev/null || echo 0)" -ge 3 ] && break
  sleep 0.1
done
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
if [ "$rc" -ne 143 ]; then
  echo "FAIL: exit code $rc after SIGTERM, expected 143"; cat "$dir/first.log"; exit 1
fi
latest=$(ls -d "$dir"/run/checkpoints/step-* 2>/dev/null | sort | tail -1)
if [ -z "$latest" ] || [ ! -f "$latest/COMMITTED" ]; then
  echo "FAIL: no complete checkpoint after SIGTERM"; ls -R "$dir/run"; cat "$dir/first.log"; exit 1
fi
grep -q "stopped by signal 15 after step" "$dir/first.log" || { echo "FAIL: no stop message"; cat "$dir/first.log"; exit 1; }
[ ! -e "$dir/run/model.safetensors" ] || { echo "FAIL: a model was exported after SIGTERM"; exit 1; }
step=$((10#${latest##*step-}))
echo "SIGTERM: checkpoint at step $step"

# A hangup: the same save and stop.
"$cli" train "$src/configs/default.yaml" "${common[@]}" --set trainer.max_steps=1000000 \
  --set checkpoint.resume=auto > "$dir/second.log" 2>&1 &
pid=$!
for _ in $(seq 1 1200); do
  grep -q "\"step\": $((step + 2)), " "$dir/run/metrics.jsonl" 2>/dev/null && break
  sleep 0.1
done
kill -HUP "$pid"
kill -HUP "$pid"
rc=0
wait "$pid" || rc=$?
if [ "$rc" -ne 129 ]; then
  echo "FAIL: exit code $rc after SIGHUP, expected 129"; cat "$dir/second.log"; exit 1
fi
hup=$(ls -d "$dir"/run/checkpoints/step-* 2>/dev/null | sort | tail -1)
hup_step=$((10#${hup##*step-}))
if [ "$hup_step" -le "$step" ] || [ ! -f "$hup/COMMITTED" ]; then
  echo "FAIL: no complete checkpoint after SIGHUP (newest: $hup)"; cat "$dir/second.log"; exit 1
fi
grep -q "stopped by signal 15 after step" "$dir/second.log" || { echo "FAIL: no stop message after SIGHUP"; cat "$dir/second.log"; exit 1; }
[ ! -e "$dir/run/model.safetensors" ] || { echo "FAIL: a model was exported after SIGHUP"; exit 1; }
echo "SIGHUP: checkpoint at step $hup_step"

"$cli" train "$src/configs/default.yaml" "${common[@]}" --set trainer.max_steps=$((hup_step + 2)) \
  --set checkpoint.resume=auto > "$dir/third.log" 2>&1 || { echo "FAIL: resume run"; cat "$dir/third.log"; exit 1; }
# Each resumed run's first step is the one after its checkpoint, logged once.
for first in $((step + 1)) $((hup_step + 1)); do
  after=$(grep -c "\"step\": $first, " "$dir/run/metrics.jsonl" || true)
  [ "$after" -eq 1 ] || { echo "FAIL: step $first logged $after times"; cat "$dir/run/metrics.jsonl"; exit 1; }
done
[ -f "$dir/run/checkpoints/step-$(printf %06d $((hup_step + 2)))/COMMITTED" ] || { echo "FAIL: no final checkpoint"; exit 1; }
[ -f "$dir/run/model.safetensors" ] || { echo "FAIL: no exported model after the resumed run"; exit 1; }
echo "resumed from step $step, stopped by SIGHUP at $hup_step, finished at $((hup_step + 2))"
