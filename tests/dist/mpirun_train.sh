#!/usr/bin/env bash
# `shardtrain train` started by mpirun, as on a cluster: the ranks run on the
# mpi backend (distributed.backend auto) and must log the single-process
# run's losses.
#   1. ddp on 2 ranks for 2 steps, saving a checkpoint each step;
#   2. resumed on 3 ranks under fsdp full_shard, to step 4;
#   3. two hosts (network namespaces joined by a veth pair) of 2 ranks each,
#      started by one mpirun whose remote agent enters the other namespace
#      instead of ssh: the world crosses the link;
#   4. distributed.backend: mpi in a job our own launcher started is refused
#      with exit 2 and a line that says to use mpirun.
# Needs root for 3 (namespaces); exits 77 (skipped) without.
set -euo pipefail
cli=$(readlink -f "$1") src=$2
cd "$src"
[ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v mpirun >/dev/null ||
  { echo "SKIP: needs root, iproute2 and mpirun (make deps installs them)"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_hwloc_base_binding_policy=none SHARDTRAIN_TIMEOUT_S=60
unset SHARDTRAIN_BACKEND
tag=stm$$
net=10.$((150 + $$ % 50)).$(($$ % 250)).
work=$(mktemp -d)
source "$(dirname "${BASH_SOURCE[0]}")/netns_hosts.sh"
trap 'hosts_down; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

common=(--set trainer.eval_every=0 --set trainer.sample_tokens=0 --set trainer.progress=none
        --set batch.global=12 --set batch.micro=1 --set batch.accumulate=null
        --set model.n_layer=2 --set model.n_embd=64 --set model.block_size=64)
losses() { python3 -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1]) if "\"loss\"" in l))' "$1"; }
# same WHAT REFERENCE GOT: the losses agree (the strategies' parity tolerance).
same() {
  python3 - "$@" <<'PY'
import sys
what, ref, got = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
print(what, "losses", got, "single", ref)
assert len(ref) == len(got) and ref, "step counts differ"
for r, g in zip(ref, got):
    assert abs(r - g) <= 1e-5 * max(1.0, abs(r)), (r, g)
PY
}

"$cli" train "${common[@]}" --set trainer.max_steps=4 --set distributed.strategy=single \
  --set run.dir="$work/single" >/dev/null 2>&1 || fail "the single-process reference run failed"
read -r -a ref < <(losses "$work/single/metrics.jsonl")

# 1. ddp x2, a checkpoint after each step.
run="$work/run"
mpirun -np 2 "$cli" train "${common[@]}" --set trainer.max_steps=2 --set distributed.strategy=ddp \
  --set checkpoint.every_n_steps=1 --set run.dir="$run" >"$work/ddp.log" 2>&1 ||
  { cat "$work/ddp.log"; fail "ddp under mpirun failed"; }
grep -q "network: MPI: " "$work/ddp.log" || { cat "$work/ddp.log"; fail "ddp under mpirun did not run on the mpi backend"; }
same "ddp x2 under mpirun" "${ref[*]:0:2}" "$(losses "$run/metrics.jsonl")" || fail "ddp under mpirun: losses differ"

# 2. resumed on 3 ranks, full_shard, to step 4.
mpirun -np 3 "$cli" train "${common[@]}" --set trainer.max_steps=4 --set distributed.strategy=fsdp \
  --set checkpoint.resume=auto --set run.dir="$run" >"$work/resume.log" 2>&1 ||
  { cat "$work/resume.log"; fail "the resumed full_shard run under mpirun failed"; }
same "ddp x2 then full_shard x3 under mpirun" "${ref[*]}" "$(losses "$run/metrics.jsonl")" ||
  fail "resumed under mpirun: losses differ"

# 3. Two hosts under one mpirun (mpirun_two_hosts: its agent starts host 1's
#    daemon inside host 1's namespace, each host with a host name of its own).
hosts_up "$tag" "$net"
run="$work/hosts"
mpirun_two_hosts "$work" "$tag" "$net" 2 \
  "$cli" train "${common[@]}" --set trainer.max_steps=4 --set distributed.strategy=ddp \
  --set run.dir="$run" >"$work/hosts.log" 2>&1 || { cat "$work/hosts.log"; fail "ddp across two hosts under mpirun failed"; }
same "ddp 2 hosts x 2 under mpirun" "${ref[*]}" "$(losses "$run/metrics.jsonl")" ||
  fail "two hosts under mpirun: losses differ"
# Bytes crossed the link (the job's gradients, not just the daemons' chatter).
sent=$(ip netns exec "${HOST_NS[1]}" cat "/sys/class/net/${HOST_DEV[1]}/statistics/tx_bytes")
[ "$sent" -gt 1000000 ] || fail "host 1 sent only $sent bytes over the link"

# 4. The mpi backend outside mpirun: refused at once, exit 2, one line.
rc=0
"$cli" train "${common[@]}" --set trainer.max_steps=1 --set distributed.strategy=ddp \
  --set distributed.backend=mpi --nproc-per-node 2 --set run.dir="$work/refused" \
  >"$work/refused.log" 2>&1 || rc=$?
[ "$rc" = 2 ] && grep -q "mpirun" "$work/refused.log" ||
  { cat "$work/refused.log"; fail "backend mpi under our launcher: exit $rc, expected 2 naming mpirun"; }
echo "mpirun OK: ddp x2, resumed as full_shard x3, two hosts; mpi outside mpirun refused"
