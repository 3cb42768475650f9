#!/usr/bin/env bash
# Ranks started with different configurations are refused at start, on every
# rank, with exit 2 and one line naming the first key that differs and the
# ranks (train/config_digest.h):
#   1. two `--nnodes 2` launchers on 127.0.0.1 (gloo) with different
#      optimizer.lr; the same two with different distributed.threads_per_rank
#      (a per-host key) train;
#   2. under mpirun (the mpi backend): ranks with different model.n_embd
#      (which used to meet in an all-reduce of other sizes: MPI_ERR_TRUNCATE,
#      then a crash) and with different trainer.max_steps (which used to
#      leave one rank waiting in a collective the other never started).
set -euo pipefail
cli=$(readlink -f "$1") src=$2
cd "$src"
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export OMP_NUM_THREADS=1 SHARDTRAIN_TIMEOUT_S=20
export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

tiny=(--set model.n_layer=1 --set model.n_embd=32 --set model.n_head=2 --set model.block_size=16
      --set batch.global=4 --set batch.micro=1 --set batch.accumulate=null --set trainer.max_steps=2
      --set trainer.eval_every=0 --set trainer.sample_tokens=0 --set trainer.progress=none
      --set distributed.strategy=ddp)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
show() { for f in "$work/$1".*; do echo "---- $f"; tail -n 30 "$f"; done; }
# The output holds the refusal and nothing of a crash or of a collective.
clean() {
  ! grep -Eq "Segmentation|terminate called|Backtrace|backtrace|signal 11|MPI Error|NBC|timed out" "$@"
}

# two NAME ARGS0 -- ARGS1: node 0 and node 1 (one rank each) as two launchers.
two() {
  local name=$1 port a=() b=()
  shift
  while [ "$1" != -- ]; do a+=("$1"); shift; done
  shift
  b=("$@")
  port=$(free_port)
  "$cli" train "${tiny[@]}" "${a[@]}" --set run.dir="$work/$name.run" --nnodes 2 --node-rank 0 \
    --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$port" >"$work/$name.0" 2>&1 &
  pids=($!)
  "$cli" train "${tiny[@]}" "${b[@]}" --set run.dir="$work/$name.run" --nnodes 2 --node-rank 1 \
    --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$port" >"$work/$name.1" 2>&1 &
  pids+=($!)
  rc0=0 rc1=0
  wait "${pids[0]}" || rc0=$?
  wait "${pids[1]}" || rc1=$?
  pids=()
}

# 1. gloo: different optimizer.lr on the two nodes.
two lr --set optimizer.lr=0.001 -- --set optimizer.lr=0.002
line="ranks 0 and 1 were started with different configurations: optimizer.lr is 0.001 on rank 0 and 0.002 on rank 1"
[ "$rc0" = 2 ] && [ "$rc1" = 2 ] || { show lr; fail "launchers with different optimizer.lr exited $rc0 and $rc1, not 2 and 2"; }
for node in 0 1; do
  grep -q "$line" "$work/lr.$node" || { show lr; fail "node $node did not say '$line'"; }
  clean "$work/lr.$node" || { show lr; fail "node $node: more than the refusal"; }
done
[ ! -e "$work/lr.run/metrics.jsonl" ] || fail "a refused job trained (metrics.jsonl written)"
echo "gloo, two launchers: different optimizer.lr refused on both with exit 2"

# Per-host keys may differ: threads per rank set per host.
two threads --set distributed.threads_per_rank=1 -- --set distributed.threads_per_rank=2
[ "$rc0" = 0 ] && [ "$rc1" = 0 ] || { show threads; fail "different distributed.threads_per_rank per node exited $rc0 and $rc1, not 0 and 0"; }
echo "gloo, two launchers: different threads_per_rank trains"

# 2. mpirun: one rank with another model.n_embd, then another max_steps.
command -v mpirun >/dev/null || { echo "SKIP: needs mpirun (make deps installs it)"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_hwloc_base_binding_policy=none
unset SHARDTRAIN_BACKEND
mpi() {
  local name=$1 key=$2 v0=$3 v1=$4 rc=0
  mpirun -np 1 "$cli" train "${tiny[@]}" --set distributed.backend=mpi --set run.dir="$work/$name.run" \
      --set "$key=$v0" \
    : -np 1 "$cli" train "${tiny[@]}" --set distributed.backend=mpi --set run.dir="$work/$name.run" \
      --set "$key=$v1" >"$work/$name.log" 2>&1 || rc=$?
  local want="ranks 0 and 1 were started with different configurations: $key is $v0 on rank 0 and $v1 on rank 1"
  [ "$rc" = 2 ] || { show "$name"; fail "mpirun, different $key: exit $rc, not 2 (139 a crash, 134 an abort)"; }
  [ "$(grep -c "^shardtrain train: configuration error: $want" "$work/$name.log")" = 2 ] ||
    { show "$name"; fail "mpirun, different $key: not one line '$want' from each rank"; }
  clean "$work/$name.log" || { show "$name"; fail "mpirun, different $key: more than the refusal"; }
  echo "mpirun: different $key refused on both ranks with exit 2"
}
mpi embd model.n_embd 32 128
mpi steps trainer.max_steps 2 4
echo "rank configurations OK"
