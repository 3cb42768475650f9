#!/usr/bin/env bash
# Training throughput benchmark: `shardtrain train` against the same GPT in
# PyTorch (bench/torch_gpt_ddp.py), side by side on this machine, in every
# mode issue 14 asks about, plus each run's fraction of the machine's one-core
# GEMM peak (bench/gemm_peak.cpp) and a per-category profile of one step of
# each gpt-25m mode. Writes the tables into BENCHMARKS.md between
# <!-- train:begin --> and <!-- train:end -->.
#
#   make bench-train       (builds, installs python3-torch, then runs this)
#   bash bench/train.sh    (when the build and python3-torch are already there)
#
# Modes (ranks x threads per rank is 2x1, or 1x1 for single):
#   gpt-25m    single fp32, DDP fp32, ZeRO-1 fp32, FULL_SHARD fp32, DDP bf16-mixed
#   llama-25m  DDP fp32, FULL_SHARD fp32, DDP bf16-mixed (8 layers, hidden 512,
#              8 heads over 2 key/value heads, SwiGLU 1408, untied head)
#   gpt2-124m  DDP fp32, FULL_SHARD fp32, DDP bf16-mixed (GPT-2 124M: 12 layers,
#              768 wide, context 1024, vocabulary 50257; global batch 2, micro 1)
#   default    single fp32, DDP fp32
# PyTorch peers: DDP, DDP + ZeroRedundancyOptimizer, DDP under bf16 autocast
# (bench/torch_gpt_ddp.py; bench/torch_llama_ddp.py for llama-25m); gpt-25m's
# FULL_SHARD is compared with shardtrain's own DDP row (PyTorch DDP shown),
# llama-25m's with PyTorch DDP.
# bf16 rows run only when the CPU has native bf16 (avx512_bf16 or amx_bf16).
#
# Environment: BUILD_DIR (default build), OUT_DIR (default $BUILD_DIR/bench-train),
# MODELS (subset of "default gpt-25m gpt2-124m llama-25m"; default the first three),
# SECTION (train; train-llama, between <!-- train-llama:begin/end -->, for
# MODELS=llama-25m: `make bench-llama`), MODES (subset of "single ddp zero1
# fsdp bf16-ddp"; FULL_SHARD's row needs ddp's beside it), PROFILE (1: profile runs, the default;
# 0: none), ROUNDS (default 3: each mode's pair of runs is repeated and the
# median shown, with the range of the per-round ratios), QUICK=1 (a few
# steps per run, one round unless ROUNDS says: a smoke test of the script, figures
# not fit for BENCHMARKS.md; the section then says QUICK). About 4 minutes a
# round plus 3 for the profiles on 2 idle cores; run it when nothing else runs
# (check `cat /proc/loadavg`).
#
# Peers run at their best known settings: OPENBLAS_NUM_THREADS=1 per rank and
# OPENBLAS_CORETYPE set to the OpenBLAS kernel set shardtrain's run of the
# same mode reports ("blas_core" in its metrics.jsonl; when absent, SKYLAKEX
# where the CPU has AVX-512 F/CD/BW/DQ/VL, else OpenBLAS's own choice), so
# both run the same GEMM kernels (see KEEP_CORETYPE below).
#
# OMP_WAIT_POLICY defaults to PASSIVE here, for both programs (they share
# LibTorch's libgomp). With libgomp's default (spin, then sleep) a 2-thread
# process on a 2-core machine that others also load spends most of its time in
# OpenMP barriers waiting for a descheduled thread. Set OMP_WAIT_POLICY=ACTIVE
# (or to an empty value: libgomp's default) to measure that behaviour instead;
# the table records the setting.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
OUT_DIR=${OUT_DIR:-$BUILD_DIR/bench-train}
MODELS=${MODELS:-"default gpt-25m gpt2-124m"}
SECTION=${SECTION:-train}          # train-llama: `make bench-llama`'s section
PROFILE=${PROFILE:-1}
QUICK=${QUICK:-0}
if [ "$QUICK" = 1 ]; then ROUNDS=${ROUNDS:-1}; else ROUNDS=${ROUNDS:-3}; fi
TORCH_PY=/usr/bin/python3          # Debian's python3-torch; the python3 on PATH may lack torch
RENDER=(python3 bench/render_train.py)
RUN_TIMEOUT=600                    # seconds per run; a hung rank fails the run instead of stalling it

# An OPENBLAS_CORETYPE in the environment (the build machines' sets Haswell,
# AVX2 kernels at half the AVX-512 speed) is removed for every run, so that
# OpenBLAS picks the kernels for this CPU; KEEP_CORETYPE=1 keeps it (and the
# peers then follow shardtrain's). The section records what the environment had.
ENV_CORETYPE=${OPENBLAS_CORETYPE-(unset)}
if [ "${KEEP_CORETYPE:-0}" != 1 ]; then
  unset OPENBLAS_CORETYPE
  [ "$ENV_CORETYPE" = "(unset)" ] || ENV_CORETYPE="$ENV_CORETYPE, removed for the runs"
fi
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
# Sized for a 2-core machine: a gpt-25m step takes about 2 s at 2 ranks, a
# run well under a minute. The first `warmup` steps are not measured (the
# first few run slow while the heap and OpenBLAS's buffers grow); the figure
# is the median step time of the rest. bench/checkpoint.sh reads the gpt-25m
# line: keep its shape.
model_spec() {
  case $1 in
    default) echo "4 4 128 128 32 8 30 10" ;;
    gpt-25m|llama-25m) echo "8 8 512 256 8 2 10 3" ;;
    gpt2-124m) echo "12 12 768 1024 2 1 5 2" ;;
    *) die "unknown model '$1' (known: default gpt-25m gpt2-124m llama-25m)" ;;
  esac
}
# Vocabulary size: bytes, except GPT-2 124M's own (its output layer is GPT-2's
# cost; the byte data uses the first 256 rows).
model_vocab() {
  case $1 in
    gpt2-124m) echo 50257 ;;
    *) echo 256 ;;
  esac
}
# What else a model sets: shardtrain's --set arguments, then the peer script.
model_extra() {
  case $1 in
    llama-25m) echo "--set model.type=llama --set model.n_kv_head=2 --set model.intermediate_size=1408" ;;
    *) echo "" ;;
  esac
}
model_peer() {
  case $1 in
    llama-25m) echo bench/torch_llama_ddp.py ;;
    *) echo bench/torch_gpt_ddp.py ;;
  esac
}
# Modes per model: name ranks strategy precision peer-flags ("-": plain DDP;
# "=ddp": no peer run, compare with PyTorch's ddp row of the model).
model_modes() {
  case $1 in
    default) printf '%s\n' "single 1 single fp32 -" "ddp 2 ddp fp32 -" ;;
    gpt-25m) printf '%s\n' "single 1 single fp32 -" "ddp 2 ddp fp32 -" "zero1 2 zero1 fp32 --zero1" \
                           "fsdp 2 fsdp fp32 =ddp" "bf16-ddp 2 ddp bf16-mixed --bf16" ;;
    llama-25m) printf '%s\n' "ddp 2 ddp fp32 -" "fsdp 2 fsdp fp32 -" "bf16-ddp 2 ddp bf16-mixed --bf16" ;;
    gpt2-124m) printf '%s\n' "ddp 2 ddp fp32 -" "fsdp 2 fsdp fp32 =ddp" "bf16-ddp 2 ddp bf16-mixed --bf16" ;;
  esac
}
PROFILE_STEPS=7 PROFILE_STEP=6   # profile runs: step 6 of 7 (warm: the first steps still grow the heap; the last saves a checkpoint)
if [ "$QUICK" = 1 ]; then
  PROFILE_STEPS=3 PROFILE_STEP=2
  model_spec() {
    case $1 in
      default) echo "4 4 128 128 32 8 5 2" ;;
      gpt-25m|llama-25m) echo "8 8 512 256 8 2 3 1" ;;
      gpt2-124m) echo "12 12 768 1024 2 1 3 1" ;;
      *) die "unknown model '$1' (known: default gpt-25m gpt2-124m llama-25m)" ;;
    esac
  }
fi

mkdir -p "$OUT_DIR"
RESULTS=$OUT_DIR/results.jsonl
: > "$RESULTS"

# ---- the machine ---------------------------------------------------------------
COMMAND="make bench-train   # runs: bash bench/train.sh"
[ "$SECTION" = train-llama ] && COMMAND="make bench-llama   # runs: MODELS=llama-25m SECTION=train-llama bash bench/train.sh"
[ "$QUICK" = 1 ] && COMMAND="QUICK=1 bash bench/train.sh"
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
"${RENDER[@]}" machine --json "$RESULTS" --date "$DATE" --command "$COMMAND" --torch "$TORCH_VERSION" \
  --omp-wait-policy "$OMP_POLICY_TEXT" --load "$LOAD_START" --quick "$QUICK" \
  --env-coretype "$ENV_CORETYPE"
has_flag() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qx "$1"; }
NATIVE_BF16=0
if has_flag avx512_bf16 || has_flag amx_bf16; then NATIVE_BF16=1; fi
# OpenBLAS kernels for the peers (and gemm_peak) when shardtrain's metrics do
# not say: SKYLAKEX on an AVX-512 CPU, else OpenBLAS's own choice.
DEFAULT_CORETYPE=
if has_flag avx512f && has_flag avx512cd && has_flag avx512bw && has_flag avx512dq && has_flag avx512vl; then
  DEFAULT_CORETYPE=SKYLAKEX
fi
echo "results: $RESULTS; peers' default OPENBLAS_CORETYPE: ${DEFAULT_CORETYPE:-(OpenBLAS picks)}"
START=$SECONDS

run() {  # echo the command, then run it with a time limit; any failure stops the script
  { printf '+'; printf ' %q' "$@"; echo; } >&2
  timeout "$RUN_TIMEOUT" "$@" < /dev/null
}
# The environment a peer (or gemm_peak) runs with: one BLAS thread, the given kernels.
peer_env() {  # peer_env CORETYPE -> env arguments, one a line
  if [ -n "$1" ]; then printf '%s\n' env OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE="$1"
  else printf '%s\n' env -u OPENBLAS_CORETYPE OPENBLAS_NUM_THREADS=1; fi
}

# ---- GEMM peak: one copy alone, then two at once (as two ranks run) ------------
# Run after the first training run, with the OpenBLAS kernels that run used.
# Built here, not by CMake, as bench/checkpoint_bench.cpp is: against Debian's
# LibTorch with the flags CMake gives the examples.
GEMM=$BUILD_DIR/bench_gemm_peak
if [ ! -x "$GEMM" ] || [ bench/gemm_peak.cpp -nt "$GEMM" ] || [ bench/bench_flags.h -nt "$GEMM" ]; then
  build_cmd=(g++ -O2 -std=gnu++17 -D_GLIBCXX_USE_CXX11_ABI=1 -isystem /usr/include/torch/csrc/api/include
             bench/gemm_peak.cpp -o "$GEMM" -Wl,--no-as-needed -ltorch -ltorch_cpu -Wl,--as-needed -lc10 -pthread)
  echo "+ ${build_cmd[*]}"
  "${build_cmd[@]}"
fi
GEMM_ARGS=(--reps 5 --seconds 0.3)
[ "$QUICK" = 1 ] && GEMM_ARGS=(--reps 2 --seconds 0.1)
GEMM_DONE=0
gemm_peak() {  # gemm_peak CORETYPE: once per benchmark, with the kernels the training runs use
  [ "$GEMM_DONE" = 0 ] || return 0
  GEMM_DONE=1
  local e
  mapfile -t e < <(peer_env "$1")
  run "${e[@]}" "$GEMM" "${GEMM_ARGS[@]}" > "$OUT_DIR/gemm-1.json"
  "${e[@]}" "$GEMM" "${GEMM_ARGS[@]}" > "$OUT_DIR/gemm-2a.json" &
  local pid_a=$!
  "${e[@]}" "$GEMM" "${GEMM_ARGS[@]}" > "$OUT_DIR/gemm-2b.json" &
  local pid_b=$!
  wait "$pid_a" && wait "$pid_b" || die "a concurrent gemm_peak copy failed"
  "${RENDER[@]}" peak --json "$RESULTS" --env "${e[*]:1}" "$OUT_DIR/gemm-1.json"
  "${RENDER[@]}" peak --json "$RESULTS" --env "${e[*]:1}" "$OUT_DIR/gemm-2a.json" "$OUT_DIR/gemm-2b.json"
}

# ---- training runs --------------------------------------------------------------
CAN_PROFILE=0
if [ "$PROFILE" = 1 ]; then
  if "$SHARDTRAIN" config --set trainer.profile_step=1 > /dev/null 2>&1; then
    CAN_PROFILE=1
  else
    echo "bench/train.sh: this shardtrain has no trainer.profile_step; profiling PyTorch only" >&2
  fi
fi

shardtrain_run() {  # shardtrain_run DIR RANKS STRATEGY PRECISION STEPS [--set ...]
  local dir=$1 np=$2 strat=$3 prec=$4 steps=$5
  shift 5
  rm -rf "$dir"
  run "$SHARDTRAIN" train configs/default.yaml \
    --set run.dir="$dir" \
    --set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$E" --set model.block_size="$T" \
    --set batch.global="$G" --set batch.micro="$M" --set batch.accumulate=null \
    --set trainer.max_steps="$steps" --set trainer.eval_every=0 --set trainer.sample_tokens=0 \
    --set trainer.progress=plain --set precision="$prec" --set model.vocab_size="$V" \
    --set distributed.strategy="$strat" --set distributed.threads_per_rank=1 \
    --nproc-per-node "$np" $EXTRA "$@"
  rm -rf "$dir/model.safetensors" "$dir/checkpoints"   # up to a few hundred MB each for gpt-25m
}
peer_run() {  # peer_run CORETYPE RANKS ARGS...
  local core=$1 np=$2
  shift 2
  local e
  mapfile -t e < <(peer_env "$core")
  local py=("$TORCH_PY" "$PEER_PY" --n-layer "$L" --n-head "$H" --n-embd "$E"
            --block-size "$T" --vocab-size "$V" --global-batch "$G" --micro "$M" --threads 1 "$@")
  if [ "$np" -eq 1 ]; then
    run "${e[@]}" "${py[@]}"
  else
    run "${e[@]}" "$SHARDTRAIN" launch --nproc-per-node "$np" -- "${py[@]}"
  fi
}

summarize() {  # summarize RUN_DIR MODE: one throughput line for a shardtrain run
  run "${RENDER[@]}" summarize --metrics "$1/metrics.jsonl" --label "$model" --mode "$2" \
    --warmup "$W" --threads 1 --global-batch "$G" --micro "$M" --block-size "$T" \
    --n-layer "$L" --n-embd "$E" --vocab-size "$V" --model-type "$([[ $model == llama* ]] && echo llama || echo gpt)" --json "$RESULTS"
}

n_rows=0
for model in $MODELS; do
  read -r L H E T G M S W <<< "$(model_spec "$model")"
  V=$(model_vocab "$model")
  EXTRA=$(model_extra "$model")
  PEER_PY=$(model_peer "$model")
  mapfile -t modes < <(model_modes "$model")
  for mode in "${modes[@]}"; do
    read -r MODE NP STRAT PREC PEER <<< "$mode"
    if [ -n "${MODES:-}" ] && [[ " $MODES " != *" $MODE "* ]]; then continue; fi
    if [ "$PREC" != fp32 ] && [ "$NATIVE_BF16" = 0 ]; then
      "${RENDER[@]}" skipped --json "$RESULTS" --label "$model" --mode "$MODE" \
        --reason "skipped: no native bf16 (no avx512_bf16 or amx_bf16; bf16 GEMM runs at a few GFLOP/s)"
      continue
    fi
    dir=$OUT_DIR/$model-$MODE
    peer_flags=()
    [ "$PEER" != - ] && [ "${PEER:0:1}" != = ] && peer_flags=("$PEER")
    # Rounds of (ours, then its peer), so that both meet the same moment of
    # the machine; "=ddp" rows take shardtrain's DDP again as their peer.
    for ((round = 1; round <= ROUNDS; round++)); do
      echo "== $model $MODE, round $round of $ROUNDS"
      shardtrain_run "$dir" "$NP" "$STRAT" "$PREC" "$S"
      summarize "$dir" "$MODE"
      CORE=$("${RENDER[@]}" coretype --metrics "$dir/metrics.jsonl" --default "$DEFAULT_CORETYPE")
      echo "peer OPENBLAS_CORETYPE for $model $MODE: ${CORE:-(OpenBLAS picks)}"
      gemm_peak "$CORE"
      if [ "$PEER" = =ddp ]; then
        shardtrain_run "$dir-ddp" "$NP" ddp "$PREC" "$S"
        summarize "$dir-ddp" "ddp@$MODE"
      else
        peer_run "$CORE" "$NP" --label "$model" --mode "$MODE" --steps "$S" --warmup "$W" --json "$RESULTS" \
          ${peer_flags[@]+"${peer_flags[@]}"}
      fi
      n_rows=$((n_rows + 2))
    done

    # One step of each gpt-25m mode under the profiler, in separate short
    # runs: the profiler slows a step, so a timed run is never profiled.
    if [ "$PROFILE" = 1 ] && [ "$model" = gpt-25m ]; then
      pdir=$OUT_DIR/$model-$MODE-profile
      files=()
      if [ "$CAN_PROFILE" = 1 ]; then
        # A failed profile run costs its column, not the benchmark.
        shardtrain_run "$pdir" "$NP" "$STRAT" "$PREC" "$PROFILE_STEPS" --set trainer.profile_step="$PROFILE_STEP" \
          || echo "bench/train.sh: the profiled shardtrain run of $model $MODE failed" >&2
        if [ -f "$pdir/profile-rank0.json" ]; then files+=("$pdir/profile-rank0.json");
        else echo "bench/train.sh: $pdir/profile-rank0.json is missing" >&2; fi
      fi
      if [ "${PEER:0:1}" != = ]; then
        mkdir -p "$pdir"
        peer_run "$CORE" "$NP" --label "$model" --steps "$PROFILE_STEPS" --warmup $((PROFILE_STEPS - 1)) \
          --profile-step "$PROFILE_STEP" --profile-out "$pdir/torch-profile-{rank}.json" \
          ${peer_flags[@]+"${peer_flags[@]}"}
        files+=("$pdir/torch-profile-rank0.json")
      fi
      [ ${#files[@]} -eq 0 ] || run python3 bench/profile_breakdown.py "${files[@]}" \
        --json "$RESULTS" --label "$model" --mode "$MODE"
    fi
  done
done

# Every timed run above appends exactly one line; fewer means a rank failed quietly.
got=$(grep -c '"step_time_s"' "$RESULTS" || true)
[ "$got" -eq "$n_rows" ] || die "$RESULTS has $got throughput lines, expected $n_rows"

ELAPSED=$((SECONDS - START))
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
echo "measured in $ELAPSED s; load average $LOAD_START before, $LOAD_END after"
"${RENDER[@]}" finish --json "$RESULTS" --elapsed "$ELAPSED" --load "$LOAD_END"
run "${RENDER[@]}" render --results "$RESULTS" --out BENCHMARKS.md --section "$SECTION"
