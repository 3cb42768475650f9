#!/usr/bin/env python3
"""`shardtrain estimate` prints the figures the formulas give.

Usage: estimate_cli.py SHARDTRAIN_CLI SOURCE_DIR

Runs the CLI on configs of known parameter count and recomputes every table
cell here, independently of the C++ code: the ZeRO model-state formulas
(docs/config.md, strategy/estimate.h), the gathered units, the activation
estimates, the totals, the communication volumes, "fits", and the pick of
`auto`. Plain Python; no torch needed.
"""
import math
import re
import subprocess
import sys

CLI, SRC = sys.argv[1], sys.argv[2]
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print("FAIL: " + msg)


def size(b):
    mib = b / (1024.0 * 1024.0)
    return "%.2f MiB" % mib if mib < 1024.0 else "%.2f GiB" % (mib / 1024.0)


def run(args):
    proc = subprocess.run([CLI, "estimate"] + args, cwd=SRC, capture_output=True, text=True)
    print("$ shardtrain estimate " + " ".join(args))
    print(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        fail("exit code %d" % proc.returncode)
    return proc.stdout


def expected_rows(psi, units, n, n_local, mixed, activations):
    """Per strategy: (state mixed, state fp32, gathered or None, total, comm)."""
    def shard(k):
        return float(-(-psi // k))  # ceil: the largest rank's shard

    states = {
        "ddp": (16 * psi, 16 * psi),
        "zero1": (4 * psi + 12 * shard(n), 8 * psi + 8 * shard(n)),
        "fsdp/shard_grad_op": (2 * psi + 14 * shard(n), 4 * psi + 12 * shard(n)),
        "fsdp/full_shard": (16 * shard(n), 16 * shard(n)),
        "fsdp/hybrid_shard": (16 * shard(n_local), 16 * shard(n_local)),
        "fsdp/no_shard": (16 * psi, 16 * psi),
    }
    top = sorted(units, reverse=True) + [0, 0]
    gathered = (top[0] + top[1]) * (2 if mixed else 4) * 2
    multi_node = n > n_local
    comm = {"ddp": 2.0, "zero1": 3.0, "fsdp/shard_grad_op": 2.0, "fsdp/full_shard": 3.0,
            "fsdp/hybrid_shard": 3.0 + 2.0 / n_local if multi_node else 3.0,
            "fsdp/no_shard": 2.0}
    colls = {"ddp": 1, "zero1": 2, "fsdp/shard_grad_op": 2, "fsdp/full_shard": 3,
             "fsdp/hybrid_shard": 4 if multi_node else 3, "fsdp/no_shard": 1}
    rows = {}
    for name, (s_mixed, s_fp32) in states.items():
        g = gathered if name in ("fsdp/full_shard", "fsdp/hybrid_shard") else None
        total = (s_mixed if mixed else s_fp32) + (g or 0) + activations
        rows[name] = (s_mixed, s_fp32, g, total, comm[name], colls[name])
    return rows


def pick(rows, budget):
    fits = [(r[4], r[5], r[3], i, name) for i, (name, r) in enumerate(rows.items())
            if r[3] <= budget]
    return min(fits)[4] if fits else None


def check(out, psi, units, n, n_local, mixed, activations, budget, configured):
    m = re.search(r"^parameters \(Ψ\): ([\d,]+) trainable$", out, re.M)
    if not m or int(m.group(1).replace(",", "")) != psi:
        fail("Ψ line: expected %d" % psi)
    rows = expected_rows(psi, units, n, n_local, mixed, activations)
    table = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] in rows:
            table[cells[0]] = cells
    if list(table) != list(rows):
        fail("table rows %s, expected %s" % (list(table), list(rows)))
    chosen = pick(rows, budget)
    for name, (s_mixed, s_fp32, g, total, comm, _) in rows.items():
        mark = ""
        if name == (chosen if configured == "auto" else configured):
            mark = "<- auto" if configured == "auto" else "<- config"
        want = [name, size(s_mixed), size(s_fp32), size(g) if g is not None else "-",
                size(activations), size(total), "%.2f Ψ" % comm,
                "yes" if total <= budget else "no"] + ([mark] if mark else [])
        got = table.get(name)
        if got != want:
            fail("row %s:\n  got      %s\n  expected %s" % (name, got, want))
    m = re.search(r"^auto would pick: (\S+)", out, re.M)
    got_pick = m.group(1) if m else "(no line)"
    want_pick = chosen if chosen else "none;"
    if got_pick != want_pick:
        fail("auto picked %s, expected %s" % (got_pick, want_pick))


def printed_units(out):
    return [int(m.group(1).replace(",", ""))
            for m in re.finditer(r"^  \S+\s+([\d,]+) parameters$", out, re.M)]


# 1. An MLP [1000, 3000, 1000]: Ψ = 6,004,000, on 3 ranks (Ψ/3 is not whole),
#    fp32. Without a BlockImpl in it the root is the only unit. The budget
#    leaves out ddp, zero1 and full_shard (gathers the whole model), so auto
#    picks shard_grad_op.
psi = 1000 * 3000 + 3000 + 3000 * 1000 + 1000
out = run(["--set", "model.type=mlp", "--set", "model.mlp_sizes=[1000,3000,1000]",
           "--set", "batch.global=24", "--set", "batch.micro=8", "--nproc-per-node", "3",
           "--set", "distributed.memory_budget_mb=60", "--set", "distributed.strategy=ddp"])
if printed_units(out) != [psi]:
    fail("mlp units %s, expected the root with all %d" % (printed_units(out), psi))
mlp_act = 8 * 4 * (1000 + 3000 + 3000 + 2 * 1000)
check(out, psi, [psi], 3, 3, False, mlp_act, 60 * 2**20, "ddp")

# 2. A 2-layer GPT (n_embd 128, vocab 256, context 128) with bf16 compute
#    copies and activation checkpointing on 2 nodes x 2 ranks, strategy auto
#    with a big budget, then a budget nothing fits.
L, H, C, T, V, B = 2, 4, 128, 128, 256, 8
psi = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
full_layer = B * T * C * (34.0 + 5.0 * H * T / C) * 2 / 2.0
gpt_act = int(L * 2.0 * B * T * C * 2 + full_layer + B * T * V * 2 * 2.0)
args = ["--set", "model.n_layer=2", "--set", "model.block_size=128", "--set", "batch.global=32",
        "--set", "batch.micro=8", "--set", "distributed.param_dtype=bf16",
        "--set", "model.activation_checkpointing=true", "--nproc-per-node", "2",
        "--nnodes", "2", "--set", "distributed.strategy=auto"]
out = run(args + ["--set", "distributed.memory_budget_mb=4096"])
units = printed_units(out)
if sum(units) != psi:
    fail("gpt units %s do not add up to Ψ=%d" % (units, psi))
check(out, psi, units, 4, 2, True, gpt_act, 4096 * 2**20, "auto")
out = run(args + ["--set", "distributed.memory_budget_mb=0.5"])
check(out, psi, units, 4, 2, True, gpt_act, 0.5 * 2**20, "auto")
if "no strategy fits the memory budget of 0.50 MiB per rank" not in out:
    fail("no 'nothing fits' message")

# 4. Tensor parallelism: the same GPT on one node of 4 ranks at
#    tensor_parallel 2. A rank holds 1/tp of every split tensor (the token
#    embedding, which is also the tied head, each layer's c_attn, c_fc and
#    both c_proj weights, and the column-parallel biases of c_attn and c_fc)
#    and the rest whole (wpe, the norms, the row-parallel biases); 1/tp of
#    the activations under sequence parallelism; the strategies run on the
#    data-parallel ranks, world / tp. The second table gives every degree.
def psi_at(t):
    split_per_layer = 12 * C * C + 7 * C
    return V * C // t + T * C + L * (split_per_layer // t + 6 * C) + 2 * C


def units_at(t):
    return sorted([(12 * C * C + 7 * C) // t + 6 * C] * L + [V * C // t + T * C + 2 * C])


def tp_table(out):
    lines = out.splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.startswith("tensor parallelism: total per rank"))
    except StopIteration:
        fail("no tensor parallelism table")
        return {}
    table = {}
    for line in lines[start + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if not cells or not cells[0].isdigit():
            break
        table[int(cells[0])] = cells
    return table


def check_tp_table(out, world, mixed, budget, degrees, marked, mark):
    table = tp_table(out)
    if sorted(table) != degrees:
        fail("tensor parallelism rows %s, expected %s" % (sorted(table), degrees))
    for t in degrees:
        rows = expected_rows(psi_at(t), units_at(t), world // t, world // t, mixed, gpt_act // t)
        want = [str(t), str(world // t)] + [size(r[3]) + ("" if r[3] <= budget else "*") for r in rows.values()]
        want += [mark] if t == marked else []
        got = [c.rstrip() for c in table.get(t, [])]
        if got != want:
            fail("tp %d row:\n  got      %s\n  expected %s" % (t, got, want))


tp_args = args[:-6] + ["--nproc-per-node", "4", "--set", "distributed.memory_budget_mb=4096"]
out = run(tp_args + ["--set", "distributed.strategy=auto", "--set", "distributed.tensor_parallel=2"])
if sorted(printed_units(out)) != units_at(2):
    fail("tp2 units %s, expected %s" % (sorted(printed_units(out)), units_at(2)))
check(out, psi_at(2), units_at(2), 2, 2, True, gpt_act // 2, 4096 * 2**20, "auto")
check_tp_table(out, 4, True, 4096 * 2**20, [1, 2, 4], 2, "<- config")

# 5. tensor_parallel auto: the least degree at which the strategy fits. A
#    budget between zero1's totals at tp 1 and tp 2 makes it 2.
zero1 = {t: expected_rows(psi_at(t), units_at(t), 4 // t, 4 // t, True, gpt_act // t)["zero1"][3] for t in (1, 2)}
budget_mb = (zero1[1] + zero1[2]) / 2 / 2**20
out = run(args[:-6] + ["--nproc-per-node", "4", "--set", "distributed.strategy=zero1",
                       "--set", "distributed.tensor_parallel=auto", "--set", "distributed.memory_budget_mb=%r" % budget_mb])
if not re.search(r"^tensor_parallel auto picks: 2 ", out, re.M) or "tensor_parallel 2 (auto)" not in out:
    fail("tensor_parallel auto did not pick 2 under a budget of %.3f MiB" % budget_mb)
check(out, psi_at(2), units_at(2), 2, 2, True, gpt_act // 2, budget_mb * 2**20, "zero1")
check_tp_table(out, 4, True, budget_mb * 2**20, [1, 2, 4], 2, "<- auto")

# 6. A pipeline: the same GPT at pipeline_parallel 2 on 4 ranks. Its units
#    are the embeddings (wte and wpe), the two layers and the head (ln_f and
#    the tied wte again); the cut whose larger stage is smallest puts the
#    embeddings and layer 0 on the first rank (V C + T C + one layer, against
#    layer 1 and the head on the second), which sets each rank's need. Two
#    data-parallel ranks per stage; 1f1b holds about one micro-batch's
#    activations (p micro-batches of 1/p of the layers).
layer = 12 * C * C + 13 * C
first, second = V * C + T * C + layer, layer + V * C + 2 * C
assert first > second
out = run(args[:-6] + ["--nproc-per-node", "4", "--set", "distributed.memory_budget_mb=4096",
                       "--set", "distributed.strategy=auto", "--set", "distributed.pipeline_parallel=2"])
if sorted(printed_units(out)) != sorted([V * C + T * C, layer]):
    fail("pp2 units %s, expected the first stage's %s" % (sorted(printed_units(out)), [V * C + T * C, layer]))
check(out, first, sorted([V * C + T * C, layer]), 2, 2, True, gpt_act, 4096 * 2**20, "auto")

# 3. Bad input is a configuration error with exit code 2.
proc = subprocess.run([CLI, "estimate", "--set", "distributed.sharding=zero2"], cwd=SRC,
                      capture_output=True, text=True)
if proc.returncode != 2 or "distributed.sharding: got 'zero2'" not in proc.stderr:
    fail("bad sharding: exit %d, stderr %s" % (proc.returncode, proc.stderr))

if FAILURES:
    print("%d check(s) failed" % len(FAILURES))
    sys.exit(1)
print("estimate OK")
