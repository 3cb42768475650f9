#!/usr/bin/env bash
# Training throughput benchmark: `shardtrain train` against the same GPT in
# PyTorch (bench/torch_gpt_ddp.py), side by side on this machine, for two model
# sizes and two modes each (one process with 2 threads; DDP with 2 ranks of 1
# thread). Writes the table into BENCHMARKS.md between <!-- train:begin --> and
# <!-- train:end -->.
#
#   make bench-train       (builds, installs python3-torch, then runs this)
#   bash bench/train.sh    (when the build and python3-torch are already there)
#
# Environment: BUILD_DIR (default build), OUT_DIR (default $BUILD_DIR/bench-train),
# MODELS (space-separated subset of "default gpt-25m") to narrow a run by hand;
# the defaults are what BENCHMARKS.md reports. About 4 minutes on 2 cores.
#
# OMP_WAIT_POLICY defaults to PASSIVE here, for both programs (they share
# LibTorch's libgomp). With libgomp's default (spin, then sleep) a 2-thread
# process on a 2-core machine that others also load spends most of its time in
# OpenMP barriers waiting for a descheduled thread: on the shared build machine
# a default-model step took ~8 s instead of ~0.3 s, in shardtrain and PyTorch
# alike. Set OMP_WAIT_POLICY=ACTIVE (or to an empty value: libgomp's default)
# to measure that behaviour instead; the table records the setting.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
OUT_DIR=${OUT_DIR:-$BUILD_DIR/bench-train}
MODELS=${MODELS:-"default gpt-25m"}
TORCH_PY=/usr/bin/python3          # Debian's python3-torch; the python3 on PATH may lack torch
RUN_TIMEOUT=600                    # seconds per run; a hung rank fails the run instead of stalling it

if [ -z "${OMP_WAIT_POLICY+set}" ]; then export OMP_WAIT_POLICY=PASSIVE; fi
if [ -z "$OMP_WAIT_POLICY" ]; then unset OMP_WAIT_POLICY; fi
OMP_POLICY_TEXT=${OMP_WAIT_POLICY:-unset (libgomp default)}

die() { echo "bench/train.sh: $*" >&2; exit 1; }

SHARDTRAIN=$BUILD_DIR/shardtrain
[ -x "$SHARDTRAIN" ] || die "$SHARDTRAIN is missing; run 'make build' (or 'make bench-train')"
[ -x "$TORCH_PY" ] || die "$TORCH_PY is missing; 'make bench-train' installs python3-torch"
TORCH_VERSION=$("$TORCH_PY" -c 'import torch, torch.distributed as d; assert d.is_available(); print(torch.__version__)') \
  || die "$TORCH_PY cannot import torch.distributed; 'make bench-train' installs python3-torch"
[ -f data/corpus.txt ] || die "data/corpus.txt is missing"

# Per model: n_layer n_head n_embd block_size global micro steps warmup.
# Batches and step counts are sized for a 2-core machine: a step takes a few
# seconds, each run well under a minute. The first `warmup` steps are not
# measured; the figure is the median step time of the rest.
model_spec() {
  case $1 in
    default) echo "4 4 128 128 32 8 30 10" ;;
    gpt-25m) echo "8 8 512 256 8 2 8 3" ;;
    *) die "unknown model '$1' (known: default gpt-25m)" ;;
  esac
}

mkdir -p "$OUT_DIR"
RESULTS=$OUT_DIR/results.jsonl
: > "$RESULTS"

COMMAND="make bench-train   # runs: bash bench/train.sh"
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
NPROC=$(nproc)
CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
CPU=${CPU:-unknown}
echo "date:    $DATE"
echo "nproc:   $NPROC  ($CPU)"
echo "command: $COMMAND"
echo "torch:   $TORCH_VERSION ($TORCH_PY)"
echo "results: $RESULTS"
echo "omp:     OMP_WAIT_POLICY=$OMP_POLICY_TEXT"
LOAD_START=$(cut -d' ' -f1 /proc/loadavg)
echo "load:    $LOAD_START (1-min load average before the run; others share this machine)"
START=$SECONDS

run() {  # echo the command, then run it with a time limit; any failure stops the script
  printf '+'; printf ' %q' "$@"; echo
  timeout "$RUN_TIMEOUT" "$@"
}

n_runs=0
for model in $MODELS; do
  read -r L H E T G M S W <<< "$(model_spec "$model")"
  # mode: ranks threads-per-rank strategy
  for mode in "1 2 single" "2 1 ddp"; do
    read -r NP TH STRAT <<< "$mode"
    dir=$OUT_DIR/$model-$STRAT
    rm -rf "$dir"
    run "$SHARDTRAIN" train configs/default.yaml \
      --set run.dir="$dir" \
      --set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$E" --set model.block_size="$T" \
      --set batch.global="$G" --set batch.micro="$M" --set batch.accumulate=null \
      --set trainer.max_steps="$S" --set trainer.eval_every=0 --set trainer.sample_tokens=0 \
      --set trainer.progress=plain \
      --set distributed.strategy="$STRAT" --set distributed.threads_per_rank="$TH" \
      --nproc-per-node "$NP"
    run "$TORCH_PY" bench/render_train.py summarize --metrics "$dir/metrics.jsonl" \
      --label "$model" --warmup "$W" --threads "$TH" --global-batch "$G" --micro "$M" \
      --block-size "$T" --json "$RESULTS"
    rm -rf "$dir/model.safetensors" "$dir/checkpoints"   # up to a few hundred MB each for gpt-25m; only metrics.jsonl is needed

    py=("$TORCH_PY" bench/torch_gpt_ddp.py --label "$model"
        --n-layer "$L" --n-head "$H" --n-embd "$E" --block-size "$T"
        --global-batch "$G" --micro "$M" --steps "$S" --warmup "$W" --threads "$TH" --json "$RESULTS")
    if [ "$NP" -eq 1 ]; then
      run "${py[@]}"
    else
      run "$SHARDTRAIN" launch --nproc-per-node "$NP" -- "${py[@]}"
    fi
    n_runs=$((n_runs + 2))
  done
done

# Every run above appends exactly one line; fewer means a rank failed quietly.
got=$(wc -l < "$RESULTS")
[ "$got" -eq "$n_runs" ] || die "$RESULTS has $got lines, expected $n_runs"

ELAPSED=$((SECONDS - START))
LOAD_END=$(cut -d' ' -f1 /proc/loadavg)
echo "measured in $ELAPSED s; load average $LOAD_START before, $LOAD_END after"
run "$TORCH_PY" bench/render_train.py render --results "$RESULTS" --out BENCHMARKS.md \
  --date "$DATE" --nproc "$NPROC" --cpu "$CPU" --torch "$TORCH_VERSION" --command "$COMMAND" \
  --omp-wait-policy "$OMP_POLICY_TEXT" --context "measured in $ELAPSED s; 1-min load average $LOAD_START before, $LOAD_END after"
