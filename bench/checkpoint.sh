#!/usr/bin/env bash
# Checkpoint benchmark (issue 6): save and load time, and peak RSS during the
# save, of a sharded checkpoint of the 25 M-parameter GPT (bench/train.sh's
# gpt-25m) under fsdp/full_shard with AdamW at world sizes 2 and 4, next to
# the time of one training step (bench/checkpoint_bench.cpp says how each is
# measured). Writes the table into BENCHMARKS.md between
# <!-- checkpoint:begin --> and <!-- checkpoint:end -->.
#
#   make bench-checkpoint       (builds, then runs this)
#   bash bench/checkpoint.sh    (when the build is already there)
#
# Environment: BUILD_DIR (default build), OUT_DIR (default
# $BUILD_DIR/bench-checkpoint; the checkpoints are written there, on the
# build's filesystem, and deleted after each run), WORLDS (default "2 4"),
# RUN_TIMEOUT (seconds per run, default 600). About 2 minutes on 2 cores.
#
# Threads: one per rank (OMP_NUM_THREADS=1); OMP_WAIT_POLICY defaults to
# PASSIVE, as in bench/train.sh (which explains why).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
OUT_DIR=${OUT_DIR:-$BUILD_DIR/bench-checkpoint}
WORLDS=${WORLDS:-"2 4"}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}

if [ -z "${OMP_WAIT_POLICY+set}" ]; then export OMP_WAIT_POLICY=PASSIVE; fi
if [ -z "$OMP_WAIT_POLICY" ]; then unset OMP_WAIT_POLICY; fi
OMP_POLICY_TEXT=${OMP_WAIT_POLICY:-unset (libgomp default)}
export OMP_NUM_THREADS=1

die() { echo "bench/checkpoint.sh: $*" >&2; exit 1; }

SHARDTRAIN=$BUILD_DIR/shardtrain
LIB=$BUILD_DIR/libshardtrain.so
[ -x "$SHARDTRAIN" ] && [ -f "$LIB" ] || die "$SHARDTRAIN or $LIB is missing; run 'make build' (or 'make bench-checkpoint')"

# The model is bench/train.sh's gpt-25m (n_layer n_head n_embd block_size
# global micro steps warmup), read from there so the benchmarks agree.
SPEC=$(sed -n 's/^ *gpt-25m) echo "\([0-9 ]*\)" ;;$/\1/p' bench/train.sh)
read -r L H E T G M S W <<< "$SPEC"
[ -n "${W:-}" ] || die "cannot read the gpt-25m spec from bench/train.sh (got '$SPEC')"

# Built here, not by CMake, as bench/memcpy_bw.cpp is: against the build's
# library and Debian's LibTorch, the flags CMake gives the examples.
BENCH=$BUILD_DIR/bench_checkpoint
if [ ! -x "$BENCH" ] || [ bench/checkpoint_bench.cpp -nt "$BENCH" ] || [ bench/bench_flags.h -nt "$BENCH" ] || [ "$LIB" -nt "$BENCH" ]; then
  LIBDIR=$(cd "$BUILD_DIR" && pwd)
  build_cmd=(g++ -O2 -std=gnu++17 -D_GLIBCXX_USE_CXX11_ABI=1 -Iinclude -isystem /usr/include/torch/csrc/api/include
             bench/checkpoint_bench.cpp -o "$BENCH" -L"$LIBDIR" -Wl,-rpath,"$LIBDIR" -lshardtrain
             -Wl,--no-as-needed -ltorch -ltorch_cpu -Wl,--as-needed -lc10 -pthread)
  echo "+ ${build_cmd[*]}"
  "${build_cmd[@]}"
fi

mkdir -p "$OUT_DIR"
RESULTS=$OUT_DIR/results.jsonl
: > "$RESULTS"

COMMAND="make bench-checkpoint   # runs: bash bench/checkpoint.sh"
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
NPROC=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS
CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
CPU=${CPU:-unknown}
FS=$(df -PT "$OUT_DIR" | awk 'NR == 2 { print $2 }')
echo "date:    $DATE"
echo "nproc:   $NPROC  ($CPU)"
echo "command: $COMMAND"
echo "model:   gpt-25m: n_layer $L n_head $H n_embd $E block $T; micro batch $M per rank"
echo "omp:     OMP_NUM_THREADS=1 OMP_WAIT_POLICY=$OMP_POLICY_TEXT"
echo "disk:    $OUT_DIR ($FS)"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)

failures=()
for world in $WORLDS; do
  log=$OUT_DIR/world$world.log
  echo "== fsdp/full_shard x$world"
  if timeout "$RUN_TIMEOUT" "$SHARDTRAIN" launch --nproc-per-node "$world" -- "$BENCH" \
       --dir "$OUT_DIR/ckpt-world$world" --n-layer "$L" --n-head "$H" --n-embd "$E" \
       --block-size "$T" --vocab 256 --micro "$M" > "$log" 2>&1; then
    # The launcher prefixes each line with "[rank R] ".
    line=$(sed -n 's/^\(\[rank 0\] \)\{0,1\}\({"world".*\)$/\2/p' "$log" | tail -n1)
    if [ -n "$line" ]; then
      echo "$line"
      echo "$line" >> "$RESULTS"
    else
      echo "no result line in $log"
      failures+=("world $world: no result line (see $log)")
    fi
  else
    rc=$?
    echo "failed (exit $rc); last lines of $log:"
    tail -n 5 "$log"
    failures+=("world $world: exit $rc, $(tail -n 1 "$log")")
  fi
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

# The table, then BENCHMARKS.md's checkpoint section replaced (or appended).
python3 - "$RESULTS" BENCHMARKS.md "$DATE" "$NPROC" "$CPU" "$COMMAND" "$L $H $E $T $M" \
  "$LOAD_START" "$LOAD_END" "$OMP_POLICY_TEXT" "$FS" "${failures[@]+"${failures[@]}"}" <<'EOF'
import json, sys
results, md, date, nproc, cpu, command, spec, load0, load1, omp, fs = sys.argv[1:12]
failures = sys.argv[12:]
L, H, E, T, M = spec.split()
rows = [json.loads(l) for l in open(results) if l.strip()]
out = ["<!-- checkpoint:begin -->", "", "## Checkpoints (issue 6)", ""]
out.append(f"- Run: {date}; `nproc` = {nproc} ({cpu}); load average {load0} at the start, {load1} at the end.")
out.append(f"- Command: `{command}`")
params = f"{rows[0]['params'] / 1e6:.1f} M parameters" if rows else "parameters"
out.append(f"- Model: GPT n_layer {L}, n_head {H}, n_embd {E}, block {T}, vocab 256 ({params}); "
           f"fsdp/full_shard (units: the blocks), AdamW; micro batch {M} x {T} tokens per rank; "
           f"one thread per rank, OMP_WAIT_POLICY={omp}.")
out.append(f"- Checkpoint: parameters and AdamW state (`exp_avg`, `exp_avg_sq`, `step`) via "
           f"`checkpoint::save_sharded`, on {fs} in the build directory, fsynced (commit protocol of "
           f"docs/checkpoints.md). Load: fresh model, strategy and optimizer, then `load_sharded` + "
           f"`reload_parameters` + `load_optimizer_state` (model and optimizer construction not included).")
out.append("- Times are the slowest rank's (each phase between barriers); step = the second training step "
           "(forward, backward, reduce-scatter, clip, AdamW). Peak RSS during the save: VmHWM after it, reset "
           "to the current RSS just before (`/proc/self/clear_refs`); the largest rank's, MB = 10^6 bytes.")
out.append("")
out.append("| world | step s | save s | load s | save / step | checkpoint MB | RSS before save MB | peak RSS during save MB | save overhead MB | loaded = saved |")
out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
for r in rows:
    out.append(f"| {r['world']} | {r['step_s']:.2f} | {r['save_s']:.2f} | {r['load_s']:.2f} | "
               f"{r['save_s'] / r['step_s']:.2f} | {r['checkpoint_bytes'] / 1e6:.1f} | "
               f"{r['rss_before_save_mb']:.0f} | {r['save_peak_rss_mb']:.0f} | "
               f"{r['save_peak_rss_mb'] - r['rss_before_save_mb']:+.0f} | {'yes' if r['verified'] else 'NO'} |")
out.append("")
for r in rows:
    out.append(f"- world {r['world']} per rank: RSS before save {r['rss_before_save_mb_per_rank']} MB, "
               f"peak during save {r['save_peak_rss_mb_per_rank']} MB "
               f"(training peak before the reset: {r['peak_rss_before_reset_mb_per_rank']} MB).")
for f in failures:
    out.append(f"- failed: {f}")
out.append("")
out.append("<!-- checkpoint:end -->")
block = "\n".join(out) + "\n"
print(block)
if not rows:
    sys.exit("no run succeeded: BENCHMARKS.md left as it was")
sys.path.insert(0, "bench")
import benchlib
# On a first run the hand-written reading goes after the markers, where a
# rerun does not overwrite it.
benchlib.write_section(md, "<!-- checkpoint:begin -->", "<!-- checkpoint:end -->", block.rstrip("\n"),
                       "bench/checkpoint.sh", after="\nReading: (to be written from these figures)\n")
EOF
[ ${#failures[@]} -eq 0 ] || die "${#failures[@]} run(s) failed (see the notes under the table)"
