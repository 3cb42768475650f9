#!/usr/bin/env bash
# Communication benchmark: shardtrain's collectives on both backends (gloo:
# our rings and shared memory; mpi: Open MPI under mpirun) against PyTorch
# Gloo and a single-thread memcpy, all on this machine, in one run. Writes the table into
# BENCHMARKS.md between <!-- comm:begin --> and <!-- comm:end -->.
#
#   make bench-comm        (builds, installs python3-torch, then runs this)
#   bash bench/comm.sh     (when the build and python3-torch are already there)
#
# Environment: BUILD_DIR (default build), OUT_DIR (default $BUILD_DIR/bench-comm),
# SIZES, WORLD_SIZES (space-separated) to narrow a run by hand; the defaults
# are what BENCHMARKS.md reports.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
OUT_DIR=${OUT_DIR:-$BUILD_DIR/bench-comm}
SIZES=${SIZES:-"1024 1048576 67108864"}
WORLD_SIZES=${WORLD_SIZES:-"2 4"}
OPS="all_reduce reduce_scatter all_gather broadcast all_to_all"
TORCH_OPS="all_reduce broadcast all_to_all"   # what PyTorch 1.13 Gloo has of OPS
# Across two network-namespace hosts (needs root; TWO_HOSTS=0 skips it):
# all_reduce at these sizes and a barrier, 1 and 2 ranks per host.
TWO_HOSTS=${TWO_HOSTS:-1}
HOST_SIZES=${HOST_SIZES:-"1024 65536 1048576"}
TORCH_PY=/usr/bin/python3          # Debian's python3-torch; the python3 on PATH may lack torch
LAUNCH_TIMEOUT=600                 # seconds; a hung collective fails the run instead of stalling it

die() { echo "bench/comm.sh: $*" >&2; exit 1; }

SHARDTRAIN=$BUILD_DIR/shardtrain
[ -x "$SHARDTRAIN" ] || die "$SHARDTRAIN is missing; run 'make build' (or 'make bench-comm')"
[ -x "$TORCH_PY" ] || die "$TORCH_PY is missing; 'make bench-comm' installs python3-torch"
TORCH_VERSION=$("$TORCH_PY" -c 'import torch, torch.distributed as d; assert d.is_available(); print(torch.__version__)') \
  || die "$TORCH_PY cannot import torch.distributed; 'make bench-comm' installs python3-torch"

# memcpy reference, rebuilt only when missing or older than its source.
MEMCPY=$BUILD_DIR/bench_memcpy
if [ ! -x "$MEMCPY" ] || [ bench/memcpy_bw.cpp -nt "$MEMCPY" ] || [ bench/bench_flags.h -nt "$MEMCPY" ]; then
  echo "+ g++ -O2 -o $MEMCPY bench/memcpy_bw.cpp"
  g++ -O2 -o "$MEMCPY" bench/memcpy_bw.cpp
fi

# Iterations per size: enough to be stable, small enough for ~5 minutes on 2 cores.
iters_for() { case $1 in 1024) echo 200 ;; 65536) echo 100 ;; 1048576) echo 20 ;; *) echo 5 ;; esac; }
warmup_for() { case $1 in 1024|65536) echo 20 ;; 1048576) echo 5 ;; *) echo 3 ;; esac; }

mkdir -p "$OUT_DIR"
RESULTS=$OUT_DIR/results.jsonl
: > "$RESULTS"

COMMAND="make bench-comm   # runs: bash bench/comm.sh"
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
NPROC=$(nproc)
CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
CPU=${CPU:-unknown}
echo "date:    $DATE"
echo "nproc:   $NPROC  ($CPU)"
echo "command: $COMMAND"
echo "torch:   $TORCH_VERSION ($TORCH_PY)"
echo "results: $RESULTS"
LOAD_START=$(cut -d' ' -f1 /proc/loadavg)
echo "load:    $LOAD_START (1-min load average before the run; others share this machine)"
START=$SECONDS

# The mpi backend's runs: mpirun on this machine, as the test suite starts it.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_hwloc_base_binding_policy=none
MPI_RESULTS=$OUT_DIR/mpi.jsonl
: > "$MPI_RESULTS"

run() {  # echo the command, then run it with a time limit; any failure stops the script
  printf '+'; printf ' %q' "$@"; echo
  timeout "$LAUNCH_TIMEOUT" "$@"
}

for n in $WORLD_SIZES; do
  for bytes in $SIZES; do
    it=$(iters_for "$bytes"); wu=$(warmup_for "$bytes")
    for op in $OPS; do
      run "$SHARDTRAIN" launch --nproc-per-node "$n" -- "$SHARDTRAIN" bench-comm \
        --op "$op" --bytes "$bytes" --dtype float32 --iters "$it" --warmup "$wu" --json "$RESULTS"
      run mpirun -np "$n" "$SHARDTRAIN" bench-comm \
        --op "$op" --bytes "$bytes" --dtype float32 --iters "$it" --warmup "$wu" --json "$MPI_RESULTS"
    done
    # all_reduce on memory from Communicator::allocate, which it reduces in
    # place (from 256 KB; DDP's buckets are such memory).
    if [ "$bytes" -ge 1048576 ]; then
      run "$SHARDTRAIN" launch --nproc-per-node "$n" -- "$SHARDTRAIN" bench-comm --buffer allocated \
        --op all_reduce --bytes "$bytes" --dtype float32 --iters "$it" --warmup "$wu" --json "$RESULTS"
    fi
    for op in $TORCH_OPS; do
      run "$SHARDTRAIN" launch --nproc-per-node "$n" -- "$TORCH_PY" bench/torch_collectives.py \
        --op "$op" --bytes "$bytes" --dtype float32 --iters "$it" --warmup "$wu" --json "$RESULTS"
    done
  done
  run "$SHARDTRAIN" launch --nproc-per-node "$n" -- "$SHARDTRAIN" bench-comm --op barrier --iters 200 --warmup 20 --json "$RESULTS"
  run mpirun -np "$n" "$SHARDTRAIN" bench-comm --op barrier --iters 200 --warmup 20 --json "$MPI_RESULTS"
  run "$SHARDTRAIN" launch --nproc-per-node "$n" -- "$TORCH_PY" bench/torch_collectives.py --op barrier --iters 200 --warmup 20 --json "$RESULTS"
  # PyTorch 1.13 Gloo has no flat reduce_scatter / all_gather: one probe each
  # records that (as a "status":"unsupported" line) instead of a number.
  for op in reduce_scatter all_gather; do
    run "$SHARDTRAIN" launch --nproc-per-node "$n" -- "$TORCH_PY" bench/torch_collectives.py \
      --op "$op" --bytes 1024 --dtype float32 --json "$RESULTS"
  done
done

run "$MEMCPY" --json "$RESULTS"
sed 's/"impl":"shardtrain"/"impl":"shardtrain-mpi"/' "$MPI_RESULTS" >> "$RESULTS"

# Two hosts: each launch is one launcher per host (namespace), rank 0's line
# marked with "hosts":2 and the ranks per host.
n_two_hosts=0
if [ "$TWO_HOSTS" = 1 ]; then
  # shellcheck source=../tests/dist/netns_hosts.sh
  source tests/dist/netns_hosts.sh
  trap hosts_down EXIT
  hosts_up stcomm 10.79.0.
  SHARDTRAIN_JOB_TOKEN=${SHARDTRAIN_JOB_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
  export SHARDTRAIN_JOB_TOKEN
  HOST_RESULTS=$OUT_DIR/two-hosts.jsonl
  : > "$HOST_RESULTS"
  port=29610
  on_two_hosts() {  # K PROGRAM ARGS...: one launcher per host, K ranks each
    local k=$1 node pids=(); shift
    port=$((port + 1))
    printf '+ on two hosts, %s per host:' "$k"; printf ' %q' "$@"; echo
    for node in 0 1; do
      ip netns exec "${HOST_NS[node]}" env GLOO_SOCKET_IFNAME="${HOST_DEV[node]}" \
        timeout "$LAUNCH_TIMEOUT" "$SHARDTRAIN" launch --nnodes 2 --node-rank "$node" \
        --nproc-per-node "$k" --master-addr "${HOST_ADDR[0]}" --master-port "$port" -- "$@" &
      pids+=($!)
    done
    for node in 0 1; do wait "${pids[node]}"; done
  }
  for k in 1 2; do
    for bytes in $HOST_SIZES barrier; do
      if [ "$bytes" = barrier ]; then args=(--op barrier --iters 200 --warmup 20)
      else args=(--op all_reduce --bytes "$bytes" --iters "$(iters_for "$bytes")" --warmup "$(warmup_for "$bytes")"); fi
      before=$(wc -l < "$HOST_RESULTS")
      on_two_hosts "$k" "$SHARDTRAIN" bench-comm "${args[@]}" --json "$HOST_RESULTS"
      on_two_hosts "$k" "$TORCH_PY" bench/torch_collectives.py "${args[@]}" --json "$HOST_RESULTS"
      sed -i "$((before + 1)),\$ s/^{/{\"hosts\":2,\"per_host\":$k,/" "$HOST_RESULTS"
      n_two_hosts=$((n_two_hosts + 2))
    done
  done
  hosts_down
  cat "$HOST_RESULTS" >> "$RESULTS"
fi

# Every launch above appends exactly one line (rank 0); fewer means a rank failed quietly.
n_ws=$(wc -w <<< "$WORLD_SIZES"); n_sizes=$(wc -w <<< "$SIZES")
n_allocated=$(for b in $SIZES; do [ "$b" -ge 1048576 ] && echo "$b"; done | wc -l)
expected=$(( n_ws * n_sizes * (2 * $(wc -w <<< "$OPS") + $(wc -w <<< "$TORCH_OPS")) + n_ws * n_allocated \
             + n_ws * 5 + 3 + n_two_hosts ))
got=$(wc -l < "$RESULTS")
[ "$got" -eq "$expected" ] || die "$RESULTS has $got lines, expected $expected"

ELAPSED=$((SECONDS - START))
LOAD_END=$(cut -d' ' -f1 /proc/loadavg)
echo "measured in $ELAPSED s; load average $LOAD_START before, $LOAD_END after"
run "$TORCH_PY" bench/render_comm.py --results "$RESULTS" --out BENCHMARKS.md \
  --date "$DATE" --nproc "$NPROC" --cpu "$CPU" --torch "$TORCH_VERSION" --command "$COMMAND" \
  --context "measured in $ELAPSED s; 1-min load average $LOAD_START before, $LOAD_END after"
