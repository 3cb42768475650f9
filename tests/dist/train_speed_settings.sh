#!/usr/bin/env bash
# What `shardtrain train` does for speed without being asked, and its step
# profile (docs/performance.md):
#   - the start-up line and metrics name OpenBLAS's kernel set, and a
#     OPENBLAS_CORETYPE that holds OpenBLAS below an AVX-512 CPU is warned about;
#   - each rank's BLAS threads equal distributed.threads_per_rank;
#   - trainer.profile_step writes each rank's profile of that step, ops by phase
#     (the fused GELU among them);
#   - two ranks of one host exchange through shared memory, and say so.
set -euo pipefail
cli=$1 src=$2
cd "$src"
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
py=python3

train() {  # train RUN_DIR [extra --set ...]
  local dir=$1; shift
  "$cli" train --set trainer.max_steps=3 --set trainer.eval_every=0 --set trainer.sample_tokens=0 \
    --set trainer.progress=plain --set distributed.nproc_per_node=2 \
    --set distributed.threads_per_rank=1 --set run.dir="$dir" "$@" 2>&1
}
field() {  # field METRICS KEY: the values of KEY over the step lines, one per line
  $py -c 'import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if sys.argv[2] in r: print(r[sys.argv[2]])' "$1" "$2" | sort -u
}

flags=$(grep -m1 '^flags' /proc/cpuinfo)
avx512=yes
for f in avx512f avx512cd avx512bw avx512dq avx512vl; do grep -qw "$f" <<<"$flags" || avx512=no; done

unset OPENBLAS_CORETYPE  # OpenBLAS's own choice first (the environment may force one)
out=$(train "$run/a" --set trainer.profile_step=2) || { echo "$out"; fail "shardtrain train exited non-zero"; }
echo "$out" | head -3
core=$(field "$run/a/metrics.jsonl" blas_core)
[ "$(wc -l <<<"$core")" -eq 1 ] || fail "ranks report different BLAS kernels: $core"
if [ -n "$core" ]; then
  grep -q "OpenBLAS $core kernels" <<<"$out" || fail "the start-up line does not name the $core kernels"
else
  grep -q "BLAS: not OpenBLAS" <<<"$out" || fail "the start-up line does not say the BLAS is not OpenBLAS"
fi
! grep -q "holds OpenBLAS to" <<<"$out" || fail "warned about OPENBLAS_CORETYPE while it was unset"
grep -q "network: .*; collectives among the ranks of this host through shared memory" <<<"$out" ||
  fail "two ranks of one host do not say they use shared memory"
[ "$(field "$run/a/metrics.jsonl" blas_threads)" = 1 ] || fail "blas_threads is not threads_per_rank (1)"

# A forced kernel set is used, and warned about where it is below the CPU.
if [ -n "$core" ]; then
  out=$(OPENBLAS_CORETYPE=HASWELL train "$run/b") || { echo "$out"; fail "train with OPENBLAS_CORETYPE set failed"; }
  [ "$(field "$run/b/metrics.jsonl" blas_core)" = Haswell ] ||
    fail "OPENBLAS_CORETYPE=HASWELL was not used: $(field "$run/b/metrics.jsonl" blas_core)"
  if [ "$avx512" = yes ]; then
    grep -q "warning: OPENBLAS_CORETYPE=HASWELL holds OpenBLAS to its Haswell kernels on a CPU with AVX-512" <<<"$out" ||
      fail "no warning for AVX2 kernels forced on an AVX-512 CPU"
  else
    ! grep -q "holds OpenBLAS to" <<<"$out" || fail "warned on a CPU without AVX-512"
  fi
  echo "OPENBLAS_CORETYPE is used, and warned about where it holds OpenBLAS back (AVX-512: $avx512)"
fi

# The profile of step 2, on each rank.
for r in 0 1; do
  $py - "$run/a/profile-rank$r.json" "$r" <<'PY' || fail "profile-rank$r.json"
import json, sys
p = json.load(open(sys.argv[1]))
assert p["impl"] == "shardtrain" and p["step"] == 2 and p["rank"] == int(sys.argv[2]), p
scopes = {s["name"]: s["total_us"] for s in p["scopes"]}
for phase in ("data", "forward", "backward", "sync", "clip", "optimizer"):
    assert scopes.get(phase, 0) > 0, f"phase {phase} missing: {scopes}"
ops = p["ops"]
gemm = [o for o in ops if o["scope"] == "forward" and o["name"] in ("aten::addmm", "aten::mm", "aten::bmm")]
assert gemm and all(o["self_us"] > 0 and o["calls"] > 0 for o in gemm), "no GEMM in forward"
assert any(o["scope"] == "backward" and o["name"] in ("aten::mm", "aten::bmm") for o in ops), "no GEMM in backward"
# The fused activation loops are ops of their own, not phases.
for name, phase in (("fused::gelu", "forward"), ("fused::gelu_backward", "backward")):
    assert any(o["name"] == name and o["scope"] == phase and o["self_us"] > 0 for o in ops), f"no {name} in {phase}"
total = sum(o["self_us"] for o in ops)
assert 0 < total <= p["step_us"] * 1.05, (total, p["step_us"])
print(f"rank {p['rank']}: {len(ops)} op rows, own time {total / 1e3:.1f} ms of a {p['step_us'] / 1e3:.1f} ms step")
PY
done
! compgen -G "$run/a/profile-rank0.json.tmp*" >/dev/null || fail "a temporary profile file was left behind"
echo "OK"
