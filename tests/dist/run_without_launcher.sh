#!/usr/bin/env bash
# Starts N ranks of PROGRAM the way another launcher would, without
# `shardtrain launch`: by hand (torchrun variables), as srun does (SLURM_*),
# as mpirun does (OMPI_COMM_WORLD_*), or as two `shardtrain launch` nodes on
# this machine. The program must behave the same under each.
#   run_without_launcher.sh MODE N CLI PROGRAM [ARGS...]
#   MODE: by-hand | slurm | openmpi | two-nodes
set -euo pipefail
mode=$1 n=$2 cli=$3
shift 3
port=$("$cli" launch --nproc-per-node 1 -- sh -c 'echo $MASTER_PORT' | sed 's/.*] //')

pids=()
case "$mode" in
  by-hand)
    for ((r = 0; r < n; r++)); do
      RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$@" &
      pids+=($!)
    done ;;
  slurm)
    # No MASTER_ADDR: the first host of the node list is the master.
    for ((r = 0; r < n; r++)); do
      SLURM_PROCID=$r SLURM_NTASKS=$n SLURM_LOCALID=$r SLURM_NODEID=0 SLURM_NNODES=1 \
      SLURM_NTASKS_PER_NODE=$n SLURM_NODELIST=localhost MASTER_PORT=$port "$@" &
      pids+=($!)
    done ;;
  openmpi)
    for ((r = 0; r < n; r++)); do
      OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=$n OMPI_COMM_WORLD_LOCAL_RANK=$r \
      OMPI_COMM_WORLD_LOCAL_SIZE=$n MASTER_PORT=$port "$@" &
      pids+=($!)
    done ;;
  two-nodes)
    half=$((n / 2))
    # Both nodes' launchers must share the job's secret.
    export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    for node in 0 1; do
      "$cli" launch --nnodes 2 --node-rank $node --nproc-per-node $half \
        --master-addr 127.0.0.1 --master-port "$port" -- "$@" &
      pids+=($!)
    done ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac

# A failure anywhere wins over a skip (77), as in `shardtrain launch`.
rc=0
for p in "${pids[@]}"; do
  code=0
  wait "$p" || code=$?
  if [ "$code" != 0 ] && { [ "$rc" = 0 ] || [ "$rc" = 77 ]; }; then rc=$code; fi
done
exit $rc
