#!/usr/bin/env bash
# Every precision mode runs `shardtrain train` to its end (final checkpoint,
# exported model, sample) and `shardtrain generate` reads what it exported;
# fp16-mixed, which needs CUDA, is refused up front as a configuration error;
# auto says what it chose and why: fp32 on a CPU without native bf16; on one
# with it, bf16-mixed or fp32 as the GEMM rates it measured (and names) say.
set -euo pipefail
cli=$1 src=$2
cd "$src"
fail() { echo "FAIL: $*"; exit 1; }
if grep -m1 '^flags' /proc/cpuinfo | grep -qwE 'avx512_bf16|amx_bf16'; then auto_runs=bf16-mixed; else auto_runs=fp32; fi
for precision in fp32 bf16-mixed bf16-true auto; do
  run=$(mktemp -d)
  out=$("$cli" train --set precision=$precision --set trainer.max_steps=2 --set trainer.eval_every=0 \
        --set trainer.sample_tokens=8 --set distributed.nproc_per_node=1 --set run.dir="$run" 2>&1) || {
    echo "$out"; rm -rf "$run"; fail "$precision: shardtrain train exited non-zero"; }
  grep -q "sample:" <<<"$out" || { rm -rf "$run"; fail "$precision: no sample printed"; }
  if [ "$precision" = auto ]; then
    if [ "$auto_runs" = bf16-mixed ]; then
      # "... (B against F GFLOP/s)": bf16-mixed exactly when B > F.
      rates=$(sed -n 's/^precision: .*(\([0-9]*\) against \([0-9]*\) GFLOP\/s).*/\1 \2/p' <<<"$out")
      [ -n "$rates" ] || { echo "$out" | head -3; rm -rf "$run"; fail "auto: the start-up line names no measured GEMM rates"; }
      read -r bf16 fp32 <<<"$rates"
      if [ "$bf16" -gt "$fp32" ]; then auto_runs=bf16-mixed; else auto_runs=fp32; fi
    fi
    grep -q "^precision: $auto_runs (auto: " <<<"$out" || {
      echo "$out" | head -3; rm -rf "$run"; fail "auto: the start-up line does not say $auto_runs and why"; }
    grep -q "\"precision\": \"$auto_runs\"" "$run/metrics.jsonl" || { rm -rf "$run"; fail "auto: metrics do not record $auto_runs"; }
  else
    grep -q "^precision: $precision\$" <<<"$out" || { rm -rf "$run"; fail "$precision: no start-up precision line"; }
  fi
  [ -f "$run/checkpoints/step-000002/COMMITTED" ] || { rm -rf "$run"; fail "$precision: no final checkpoint"; }
  [ -f "$run/model.safetensors" ] || { rm -rf "$run"; fail "$precision: no exported model"; }
  gen=$("$cli" generate --checkpoint "$run/model.safetensors" --prompt "The " --max-new-tokens 4 2>/dev/null) || {
    rm -rf "$run"; fail "$precision: generate could not read the exported model"; }
  rm -rf "$run"
  [[ "$gen" == The* ]] || fail "$precision: generate output does not start with the prompt: $gen"
  echo "$precision OK"
done
set +e
out=$("$cli" train --set precision=fp16-mixed --set trainer.max_steps=1 --set run.dir=/nonexistent/never 2>&1)
rc=$?
set -e
[ "$rc" -eq 2 ] || { echo "$out"; fail "fp16-mixed on CPU: expected exit 2 (configuration error), got $rc"; }
grep -q "needs a CUDA device" <<<"$out" || { echo "$out"; fail "fp16-mixed: the error does not say why"; }
echo "fp16-mixed refused as a configuration error"
