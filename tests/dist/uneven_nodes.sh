#!/usr/bin/env bash
# Nodes that start different numbers of ranks: two launchers on this host,
# node 0 with --nproc-per-node 2 and node 1 with 1, a world of 3. ddp, zero1,
# fsdp (full_shard) and strategy auto over it log world_size 3 and the losses
# of one launcher of 3 ranks (1e-6 relative); hybrid_shard and tensor_parallel=2, which need the same ranks on
# every node, are refused on both nodes with one line naming the sizes.
set -euo pipefail
cli=$(readlink -f "$1") src=$2
cd "$src"
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export OMP_NUM_THREADS=1 SHARDTRAIN_TIMEOUT_S=${SHARDTRAIN_TIMEOUT_S:-120}
# Launchers started separately share the job's secret.
export SHARDTRAIN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

# global 6 = micro 1 x accumulate 2 x 3 ranks.
common=(configs/default.yaml --set model.n_layer=2 --set model.n_embd=64 --set model.n_head=2
        --set model.block_size=32 --set batch.global=6 --set batch.micro=1 --set batch.accumulate=null
        --set trainer.max_steps=5 --set trainer.eval_every=0 --set trainer.sample_tokens=0)

losses() { python3 -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1]) if "\"loss\"" in l and "eval" not in l))' "$1"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# uneven NAME ARGS...: `shardtrain train` on node 0 (2 ranks) and node 1
# (1 rank); their output goes to $work/NAME.0.log and .1.log, their exit
# codes to rc0 and rc1.
uneven() {
  local name=$1 port
  shift
  port=$(free_port)
  pids=()
  for node in 0 1; do
    "$cli" train "${common[@]}" "$@" --nnodes 2 --node-rank "$node" --nproc-per-node $((2 - node)) \
      --master-addr 127.0.0.1 --master-port "$port" >"$work/$name.$node.log" 2>&1 &
    pids+=($!)
  done
  rc0=0 rc1=0
  wait "${pids[0]}" || rc0=$?
  wait "${pids[1]}" || rc1=$?
  pids=()
}
show() { for f in "$work/$1".*.log; do echo "---- $f"; tail -n 40 "$f"; done; }

# Each plain data-parallel strategy over nodes of 2 and 1 ranks against its
# reference, one launcher of 3 ranks; strategy auto chooses among them.
for strategy in ddp zero1 fsdp auto; do
  sets=(--set distributed.strategy="$strategy")
  "$cli" train "${common[@]}" "${sets[@]}" --set run.dir="$work/$strategy.ref" --nproc-per-node 3 \
    >"$work/$strategy.ref.log" 2>&1 || { tail -n 40 "$work/$strategy.ref.log"; fail "$strategy: the 3-rank reference run failed"; }
  reference=$(losses "$work/$strategy.ref/metrics.jsonl")
  [ "$(wc -w <<<"$reference")" -eq 5 ] || fail "$strategy: the reference logged '$reference', not 5 losses"

  uneven "$strategy" "${sets[@]}" --set run.dir="$work/$strategy"
  [ "$rc0" = 0 ] && [ "$rc1" = 0 ] || { show "$strategy"; fail "$strategy over nodes of 2 and 1 ranks exited $rc0 and $rc1"; }
  grep -q '"world_size": 3' "$work/$strategy/metrics.jsonl" || fail "$strategy: metrics.jsonl does not say world_size 3"
  grep -q "nodes run 2,1 ranks: 3 in all" "$work/$strategy.0.log" || { show "$strategy"; fail "node 0 did not say the node sizes"; }
  got=$(losses "$work/$strategy/metrics.jsonl")
  python3 - "$reference" "$got" <<'PY' || fail "$strategy over nodes of 2 and 1 ranks: losses $got, one launcher of 3: $reference"
import sys
ref, got = ([float(x) for x in a.split()] for a in sys.argv[1:3])
assert len(ref) == len(got) == 5, (ref, got)
for r, g in zip(ref, got):
    assert abs(r - g) <= 1e-6 * abs(r), (r, g)
PY
  echo "$strategy over nodes of 2 and 1 ranks: losses $got (one launcher of 3 ranks: the same)"
done

# What needs the same ranks on every node is refused, as bad input (2), on both.
for refused in hybrid tp; do
  case $refused in
    hybrid) sets=(--set distributed.strategy=fsdp --set distributed.sharding=hybrid_shard)
            line="distributed.sharding=hybrid_shard needs the same number of ranks on every node, but the nodes run 2,1 ranks" ;;
    tp) sets=(--set distributed.tensor_parallel=2)
        line="distributed.tensor_parallel=2 needs the same number of ranks on every node, but the nodes run 2,1 ranks" ;;
  esac
  uneven "$refused" "${sets[@]}" --set run.dir="$work/$refused"
  [ "$rc0" = 2 ] && [ "$rc1" = 2 ] || { show "$refused"; fail "$refused over uneven nodes exited $rc0 and $rc1, not 2 and 2"; }
  cat "$work/$refused".*.log | grep -q "$line" || { show "$refused"; fail "$refused: no line '$line'"; }
  echo "$refused over nodes of 2 and 1 ranks: refused with '$line'"
done
echo "PASS"
