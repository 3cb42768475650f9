#!/usr/bin/env bash
# Sharding benchmark (issue 5): every `shardtrain train` strategy on the 25 M
# parameter GPT at world sizes 2 and 4 (ddp, zero1, fsdp no_shard /
# shard_grad_op / full_shard, and at world 4 fsdp hybrid_shard as 2 launcher
# "nodes" x 2 ranks), next to PyTorch's DistributedDataParallel with a plain
# AdamW and with ZeroRedundancyOptimizer (bench/torch_gpt_ddp.py [--zero1]) on
# the same model, data and batch, in the same run. Reports tokens/s, peak RSS
# per rank and, for shardtrain, communication busy / exposed seconds per step
# and the fraction of it that overlap hides. Writes the table into
# BENCHMARKS.md between <!-- sharding:begin --> and <!-- sharding:end -->.
#
#   make bench-sharding       (builds, installs python3-torch, then runs this)
#   bash bench/sharding.sh    (when the build and python3-torch are already there)
#
# Environment: BUILD_DIR (default build), OUT_DIR (default
# $BUILD_DIR/bench-sharding), WORLDS (default "2 4"), MODES (default: all;
# space-separated subset of "pt-ddp ddp zero1 no_shard shard_grad_op
# full_shard hybrid_shard pt-zero1") and RUN_TIMEOUT (seconds per run, default
# 300) to narrow a run by hand; the defaults are what BENCHMARKS.md reports.
# About 15 minutes on 2 cores.
#
# A run that fails or times out does not stop the benchmark: its row says
# "failed", and its exit code and last log lines go into the notes under the
# table (full logs: $OUT_DIR/<world>-<mode>.log).
#
# Threads: one per rank at both world sizes (world 4 puts 4 ranks on this
# 2-core machine). OMP_WAIT_POLICY defaults to PASSIVE, as in bench/train.sh
# (which explains why); set it to ACTIVE or empty to measure otherwise.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
OUT_DIR=${OUT_DIR:-$BUILD_DIR/bench-sharding}
WORLDS=${WORLDS:-"2 4"}
ALL_MODES="pt-ddp ddp zero1 no_shard shard_grad_op full_shard hybrid_shard pt-zero1"
MODES=${MODES:-$ALL_MODES}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
TORCH_PY=/usr/bin/python3          # Debian's python3-torch; the python3 on PATH may lack torch
THREADS=1                          # per rank, at every world size

if [ -z "${OMP_WAIT_POLICY+set}" ]; then export OMP_WAIT_POLICY=PASSIVE; fi
if [ -z "$OMP_WAIT_POLICY" ]; then unset OMP_WAIT_POLICY; fi
OMP_POLICY_TEXT=${OMP_WAIT_POLICY:-unset (libgomp default)}

die() { echo "bench/sharding.sh: $*" >&2; exit 1; }

SHARDTRAIN=$BUILD_DIR/shardtrain
[ -x "$SHARDTRAIN" ] || die "$SHARDTRAIN is missing; run 'make build' (or 'make bench-sharding')"
[ -x "$TORCH_PY" ] || die "$TORCH_PY is missing; 'make bench-sharding' installs python3-torch"
TORCH_VERSION=$("$TORCH_PY" -c 'import torch, torch.distributed as d; assert d.is_available(); print(torch.__version__)') \
  || die "$TORCH_PY cannot import torch.distributed; 'make bench-sharding' installs python3-torch"
[ -f data/corpus.txt ] || die "data/corpus.txt is missing"
for m in $MODES; do
  case " $ALL_MODES " in *" $m "*) ;; *) die "unknown mode '$m' (known: $ALL_MODES)" ;; esac
done

# The model, batch and step counts are bench/train.sh's gpt-25m, read from
# there so the two benchmarks measure the same thing:
# n_layer n_head n_embd block_size global micro steps warmup.
SPEC=$(sed -n 's/^ *gpt-25m) echo "\([0-9 ]*\)" ;;$/\1/p' bench/train.sh)
read -r L H E T G M S W <<< "$SPEC"
[ -n "${W:-}" ] || die "cannot read the gpt-25m spec from bench/train.sh (got '$SPEC')"

mkdir -p "$OUT_DIR"
RESULTS=$OUT_DIR/results.jsonl
: > "$RESULTS"

COMMAND="make bench-sharding   # runs: bash bench/sharding.sh"
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
NPROC=$(nproc)
CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
CPU=${CPU:-unknown}
echo "date:    $DATE"
echo "nproc:   $NPROC  ($CPU)"
echo "command: $COMMAND"
echo "torch:   $TORCH_VERSION ($TORCH_PY)"
echo "model:   gpt-25m: n_layer $L n_head $H n_embd $E block $T; global batch $G, micro $M; $S steps, $W warmup"
echo "results: $RESULTS"
echo "omp:     OMP_WAIT_POLICY=$OMP_POLICY_TEXT"
LOAD_START=$(cut -d' ' -f1 /proc/loadavg)
echo "load:    $LOAD_START (1-min load average before the run; others share this machine)"
START=$SECONDS

RENDER=("$TORCH_PY" bench/render_sharding.py)

# attempt LOG CMD...: echo CMD, run it under the time limit with its output
# also in LOG; sets rc (0, the exit code, or 124 on time-out) without stopping.
attempt() {
  local log=$1; shift
  printf '+'; printf ' %q' "$@"; echo
  set +e
  timeout -k 30 "$RUN_TIMEOUT" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
}

# record_failure WORLD IMPL MODE LOG [REASON]: a "failed" row with the exit
# code (or REASON) and the log's last lines.
record_failure() {
  echo "bench/sharding.sh: $2 $3 at world $1 failed (exit $rc${5:+: $5}); see $4" >&2
  "${RENDER[@]}" fail --world "$1" --impl "$2" --mode "$3" --exit-code "$rc" \
    --timeout "$RUN_TIMEOUT" --reason "${5:-}" --log "$4" --json "$RESULTS"
}

# Sets cmd to `shardtrain train` with the gpt-25m spec and the given overrides.
train_cmd() {  # DIR STRATEGY-OVERRIDES...
  local dir=$1; shift
  cmd=("$SHARDTRAIN" train configs/default.yaml \
    --set run.dir="$dir" \
    --set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$E" --set model.block_size="$T" \
    --set batch.global="$G" --set batch.micro="$M" --set batch.accumulate=null \
    --set trainer.max_steps="$S" --set trainer.eval_every=0 --set trainer.sample_tokens=0 \
    --set trainer.progress=plain --set distributed.threads_per_rank="$THREADS" "$@")
}

run_shardtrain() {  # WORLD MODE
  local world=$1 mode=$2 dir=$OUT_DIR/$1-$2 log=$OUT_DIR/$1-$2.log strat
  case $mode in
    ddp|zero1) strat=(--set distributed.strategy="$mode") ;;
    *) strat=(--set distributed.strategy=fsdp --set distributed.sharding="$mode") ;;
  esac
  rm -rf "$dir"
  local cmd
  train_cmd "$dir" "${strat[@]}"
  if [ "$mode" = hybrid_shard ]; then
    # Two launcher "nodes" of world/2 ranks on this machine (as
    # tests/dist/run_without_launcher.sh two-nodes): hybrid_shard shards within
    # a node (LOCAL_WORLD_SIZE ranks) and replicates across the two.
    local half=$((world / 2)) port
    port=$("$TORCH_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    local node_cmd=(launch --nnodes 2 --nproc-per-node "$half" --master-addr 127.0.0.1 --master-port "$port")
    # Node 1 in the background (its output only in its log), node 0 in front.
    rm -f "$log.node1.rc"
    ( attempt "$log.node1" "$SHARDTRAIN" "${node_cmd[@]}" --node-rank 1 -- "${cmd[@]}"
      echo "$rc" > "$log.node1.rc" ) > /dev/null &
    local node1=$!
    attempt "$log" "$SHARDTRAIN" "${node_cmd[@]}" --node-rank 0 -- "${cmd[@]}"
    wait "$node1" || true
    local rc1
    rc1=$(cat "$log.node1.rc" 2>/dev/null || echo 1)
    if [ "$rc" -eq 0 ] && [ "$rc1" -ne 0 ]; then rc=$rc1; log=$log.node1; fi
  else
    attempt "$log" "${cmd[@]}" --nproc-per-node "$world"
  fi
  if [ "$rc" -eq 0 ]; then
    "${RENDER[@]}" summarize --metrics "$dir/metrics.jsonl" --world "$world" --mode "$mode" \
      --warmup "$W" --threads "$THREADS" --global-batch "$G" --micro "$M" --block-size "$T" --json "$RESULTS" \
      || { rc=$?; record_failure "$world" shardtrain "$mode" "$log" "exited 0, but its metrics.jsonl could not be summarised"; }
  else
    record_failure "$world" shardtrain "$mode" "$log"
  fi
  rm -rf "$dir/model.safetensors" "$dir/checkpoints"   # a few hundred MB each for gpt-25m; only metrics.jsonl is needed
}

run_pytorch() {  # WORLD MODE (pt-ddp | pt-zero1)
  local world=$1 mode=$2 log=$OUT_DIR/$1-$2.log extra=()
  [ "$mode" = pt-zero1 ] && extra=(--zero1)
  local before
  before=$(wc -l < "$RESULTS")
  attempt "$log" "$SHARDTRAIN" launch --nproc-per-node "$world" -- \
    "$TORCH_PY" bench/torch_gpt_ddp.py --label gpt-25m \
    --n-layer "$L" --n-head "$H" --n-embd "$E" --block-size "$T" \
    --global-batch "$G" --micro "$M" --steps "$S" --warmup "$W" --threads "$THREADS" \
    --json "$RESULTS" "${extra[@]}"
  if [ "$(wc -l < "$RESULTS")" -eq $((before + 1)) ]; then
    # Measured. A failure after the result line is in teardown (see
    # torch_gpt_ddp.py's --teardown-timeout): keep the figures, note it.
    [ "$rc" -eq 0 ] || "${RENDER[@]}" note --world "$world" --impl pytorch --mode "${mode#pt-}" \
      --text "exit code $rc after its result was written (teardown)" --log "$log" --json "$RESULTS"
    return
  fi
  if [ "$rc" -ne 0 ]; then
    record_failure "$world" pytorch "${mode#pt-}" "$log"
  else
    record_failure "$world" pytorch "${mode#pt-}" "$log" "exited 0 without its result line"
  fi
}

for world in $WORLDS; do
  for mode in $MODES; do
    [ "$mode" = hybrid_shard ] && [ "$world" -lt 4 ] && continue   # needs 2 nodes of >= 2 ranks
    echo "=== world $world: $mode ($((SECONDS - START)) s elapsed)"
    case $mode in
      pt-*) run_pytorch "$world" "$mode" ;;
      *) run_shardtrain "$world" "$mode" ;;
    esac
  done
done

ELAPSED=$((SECONDS - START))
LOAD_END=$(cut -d' ' -f1 /proc/loadavg)
echo "measured in $ELAPSED s; load average $LOAD_START before, $LOAD_END after"
"${RENDER[@]}" render --results "$RESULTS" --out BENCHMARKS.md \
  --date "$DATE" --nproc "$NPROC" --cpu "$CPU" --torch "$TORCH_VERSION" --command "$COMMAND" \
  --omp-wait-policy "$OMP_POLICY_TEXT" --threads "$THREADS" \
  --context "measured in $ELAPSED s; 1-min load average $LOAD_START before, $LOAD_END after"
