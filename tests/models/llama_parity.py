#!/usr/bin/python3
"""The Llama family against an independent implementation.

shardtrain's Llama decoder, its Hugging Face loader and exporter and its
trainer are compared with tests/reference/llama_ref.py, a PyTorch
implementation written from the architecture's definition, on random tiny
Hugging Face directories that the reference writes:

    llama_parity.py logits LLAMA_LOGITS SRC
        logits of every variant (full forward, packed rows, and the KV-cached
        forward one token at a time) within 1e-5 of the reference's
    llama_parity.py train CLI SRC VARIANT STRATEGY[xN] [bf16|bf16-true] [KEY=VALUE ...] [+MAKE_ARG=VALUE ...] [clip=X]
        10 training steps through `shardtrain train` (launcher, data sampler,
        strategy, exporter) against the reference's loop on the same batches:
        the per-step losses and gradient norms, and the exported weights.
        KEY=VALUE are config overrides (distributed.tensor_parallel=2: the
        tensor-parallel layouts; distributed.tensor_parallel=auto with a
        budget between the estimates at tp 1 and 2, which must take 2); +ARG=VALUE goes to the reference's `make`
        of the variant (+--num_key_value_heads=2); clip=X sets the clipping
        norm of both (small enough that it fires every step)
    llama_parity.py export CLI SRC
        an exported directory reloads bit for bit (whole and in shards), and
        the reference reads it
    llama_parity.py reshard CLI SRC SAVE_SPEC LOAD_SPEC...
        a checkpoint written at step 5 under SAVE_SPEC (STRATEGY[xN][:tpK][:ppJ])
        resumes under each LOAD_SPEC; steps 6..10 and the exported weights
        match the reference's
    llama_parity.py eval CLI SRC SPEC...
        the held-out loss through a pipeline equals one process's, and each
        step's metrics carry the pipeline's busy and idle times and bubble
    llama_parity.py packed CLI LLAMA_LOGITS SRC STRATEGY[xN][:tpK][:ppJ] [KEY=VALUE ...]
        masked prompt/completion records packed several to a row: the
        micro-batches shardtrain's task serves train the reference, and
        shardtrain the same data under the layout (one data-parallel rank)
    llama_parity.py lora CLI SRC STRATEGY[xN][:tpK] [KEY=VALUE ...]
        a PEFT adapter written by the reference trains 10 steps in both; the
        saved adapters match, in the PEFT names and config

Every command exits 0 when all checks pass, 1 naming the first that failed.
Run with the system Python (Debian's python3-torch).
"""
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REF = os.path.join(HERE, "..", "reference", "llama_ref.py")
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
from llama_ref import read_safetensors, load_hf_dir  # noqa: E402

# The variants every check runs on. Each covers what the others do not:
#   gqa_llama3: 4 heads over 2 key/value heads, untied head, Llama-3.1 rope
#     scaling in every band: head_dim 16, rope_theta 100 and an original
#     context of 64 give wavelengths 2 pi 100^(i/8) = 6.3, 11.2 (kept, under
#     64/4), 19.9, 35.3, 62.8 (blended, 16 to 64) and 112, 199, 353 (divided
#     by 8, over 64/1);
#   tied_qwen2: Qwen2 (q/k/v biases), tied head, one key/value head, weights
#     in 3 index shards;
#   mistral_head_dim: Mistral, head_dim 24 != hidden / heads, BF16 files;
#   biases: attention_bias and mlp_bias on every projection, rms_norm_eps 1e-2
#     (large enough that an ignored epsilon shows).
VARIANTS = {
    "gqa_llama3": ["--num_key_value_heads", "2", "--rope_theta", "100.0",
                   "--rope_scaling", json.dumps({"rope_type": "llama3", "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 64})],
    "tied_qwen2": ["--model_type", "qwen2", "--tie_word_embeddings", "true",
                   "--num_key_value_heads", "1", "--shards", "3", "--rope_theta", "1000000.0"],
    "mistral_head_dim": ["--model_type", "mistral", "--head_dim", "24", "--num_key_value_heads", "4",
                         "--dtype", "BF16"],
    "biases": ["--attention_bias", "true", "--mlp_bias", "true", "--rms_norm_eps", "0.01"],
}

STEPS = 10
BLOCK = 32
GLOBAL = 8
MICRO = 2
# fp32: the two implementations order their float32 sums differently (fused
# baddbmm against matmul, the loss reduction, Adam's update). One step agrees
# to about 1e-7 relative; AdamW divides by sqrt(v) + eps, so a gradient
# element near zero can move its parameter by a few lr-relative ulps more,
# and ten steps at lr 4e-3 stay within 5e-5 absolute (measured about 1e-5).
FP32 = {"loss": 2e-5, "param_atol": 5e-5, "param_rtol": 1e-4, "norm_atol": 1e-5, "norm_rtol": 1e-4}
# bf16-mixed against the reference under torch.autocast(bf16): both round
# GEMM inputs to bf16 (2^-8 relative), but not at the same places (autocast
# keeps the residual stream and the norms in fp32 and rounds each GEMM's
# inputs, shardtrain computes in its own mixed layout), so single elements
# are not comparable: AdamW turns a gradient element that is mostly rounding
# noise into a full lr-sized step of either sign (a rarely seen token's
# embedding row). What is comparable is each tensor's whole update:
# |ours - ref| / |ref - initial| (Frobenius) <= 0.08, measured <= 0.035, and
# the loss, a mean over thousands of rounded terms, within 2e-3 relative
# (measured 1e-4). An fp32 bug (rope, GQA, a norm) moves both by far more.
# Not compared in bf16: k_proj.bias, whose gradient would vanish (q.b is the
# same for every key of a query) but for the rotation; in bf16 it is mostly
# rounding noise, which AdamW scales to full steps (measured 0.68).
BF16 = {"loss_rtol": 2e-3, "update_rtol": 0.08}
# bf16-true against the same autocast reference: the weights themselves are
# bf16, rounded after every update (2^-8 of the weight, against updates of
# about lr), so the run drifts further from the fp32-weight reference:
# measured 2.1e-3 relative in the loss at step 10, the same under ddp and
# tensor parallelism. A norm weight starts at 1.0, where a bf16 step is 2^-7
# and the reference's ten updates add up to about 0.02: most of them round
# away (its update differs by 0.68 of the reference's), so norm weights are
# not compared; every matrix and embedding is (measured <= 0.056).
BF16_TRUE = {"loss_rtol": 5e-3, "update_rtol": 0.08, "skip_norm_weights": True}


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def run(cmd, what, env=None, cwd=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    if p.returncode != 0:
        print(p.stdout[-4000:])
        print(p.stderr[-4000:])
        fail(f"{what} exited {p.returncode}: {' '.join(cmd)}")
    return p.stdout


def ref(*args):
    return run([sys.executable, REF, *args], "llama_ref.py " + args[0])


# The reference's `make` and `train` are deterministic functions of their
# inputs, and many checks ask for the same ones (every data-parallel
# strategy compares with the same reference run). Their outputs are kept in
# SHARDTRAIN_REF_CACHE (set by llama.cmake to a directory of the build
# tree), keyed by the reference's source, the content of every input file or
# directory and the other arguments; unset, nothing is kept.
def _digest(items):
    h = hashlib.sha256()
    with open(REF, "rb") as f:
        h.update(f.read())
    for item in items:
        paths = ([os.path.join(item, n) for n in sorted(os.listdir(item))] if os.path.isdir(item)
                 else [item] if os.path.isfile(item) else [])
        for path in paths:
            with open(path, "rb") as f:
                h.update(os.path.basename(path).encode() + b"\0" + f.read())
        if not paths:
            h.update(str(item).encode())
        h.update(b"\1")
    return h.hexdigest()


def cached_ref(inputs, outputs, *args):
    """ref(*args), which writes `outputs` (files or directories), unless a
    run with the same inputs (paths whose content counts) and other
    arguments already did: then its outputs are copied into place."""
    cache = os.environ.get("SHARDTRAIN_REF_CACHE")
    if not cache:
        ref(*args)
        return
    entry = os.path.join(cache, _digest(list(inputs) + [a for a in args if a not in outputs and a not in inputs]))
    if not os.path.isdir(entry):
        ref(*args)
        os.makedirs(cache, exist_ok=True)
        staging = tempfile.mkdtemp(dir=cache, prefix=".staging-")
        for i, path in enumerate(outputs):
            (shutil.copytree if os.path.isdir(path) else shutil.copyfile)(path, os.path.join(staging, str(i)))
        try:
            os.rename(staging, entry)  # whole or not at all; a concurrent twin may have stored it first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
        return
    for i, path in enumerate(outputs):
        stored = os.path.join(entry, str(i))
        (shutil.copytree if os.path.isdir(stored) else shutil.copyfile)(stored, path)


def make_variant(work, name, extra=()):
    path = os.path.join(work, name)
    args = list(VARIANTS[name]) + list(extra)
    cached_ref([], [path], "make", path, *args)
    return path


def max_diff(a, b):
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())


# ---- logits ------------------------------------------------------------------------------

def cmd_logits(logits_bin, src):
    work = tempfile.mkdtemp(prefix="llama_parity_")
    try:
        gen = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, 256, (2, 20), generator=gen).tolist()
        # Row 1 is packed: three samples of 7, 9 and 4 tokens, positions restarting.
        segments = [[0] * 20, [0] * 7 + [1] * 9 + [2] * 4]
        positions = [list(range(20)), list(range(7)) + list(range(9)) + list(range(4))]
        inputs = os.path.join(work, "in.json")
        with open(inputs, "w") as f:
            json.dump({"tokens": tokens, "positions": positions, "segments": segments}, f)
        for name in VARIANTS:
            d = make_variant(work, name)
            ours = os.path.join(work, name + ".ours.json")
            run([logits_bin, d, inputs, ours], "llama_logits " + name)
            theirs = os.path.join(work, name + ".ref.json")
            ref("logits", d, "--tokens", inputs, "--out", theirs)
            with open(ours) as f:
                o = json.load(f)
            with open(theirs) as f:
                r = json.load(f)
            full = max_diff(o["logits"], r["logits"])
            cached = max_diff(o["cached"], r["logits"][0])
            print(f"{name}: logits max |diff| {full:.2e}, cached {cached:.2e}")
            if not full <= 1e-5:
                fail(f"{name}: logits differ from the reference by {full:.3e} (> 1e-5)")
            if not cached <= 1e-5:
                fail(f"{name}: KV-cached logits differ from the reference by {cached:.3e} (> 1e-5)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- training ----------------------------------------------------------------------------

def strategy_args(spec):
    """'ddp' / 'zero1x2' / 'full_shardx2' / 'hybrid_shardx4' -> (nproc, --set args)."""
    name, _, n = spec.partition("x")
    world = int(n or 1)
    if name in ("single", "ddp", "zero1"):
        sets = [f"distributed.strategy={name}"]
    else:
        sets = ["distributed.strategy=fsdp", f"distributed.sharding={name}"]
    return world, sets


def train_sets(hf_dir, run_dir, spec, extra_sets=(), steps=STEPS):
    """(world, the --set values of a run of `spec`)."""
    world, sets = strategy_args(spec)
    return world, sets + [
        "model.type=auto", f"model.init_from={hf_dir}", f"model.block_size={BLOCK}",
        f"batch.global={GLOBAL}", f"batch.micro={MICRO}", "batch.accumulate=null",
        f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.sample_tokens=0",
        "trainer.progress=none", "distributed.threads_per_rank=1", "schedule.warmup_steps=2",
        f"run.dir={run_dir}", "data.train=data/corpus.txt",
    ] + list(extra_sets)


LAST_OUTPUT = [""]  # what the last one-launcher run printed


def shardtrain_train(cli, src, hf_dir, run_dir, spec, extra_sets=(), port=None, steps=STEPS, with_norms=False):
    world, sets = train_sets(hf_dir, run_dir, spec, extra_sets, steps)
    args = [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDTRAIN_TIMEOUT_S="120")
    if spec.startswith("hybrid_shard"):
        env["SHARDTRAIN_JOB_TOKEN"] = os.urandom(16).hex()
        # Two nodes of world/2 ranks on this host: hybrid shards within a node
        # and replicates across the two.
        if port is None:  # a port nobody holds now (the launchers bind it at once)
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        procs = []
        for node in (0, 1):
            cmd = [cli, "train", "configs/default.yaml", *args, "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", str(world // 2), "--master-addr", "127.0.0.1",
                   "--master-port", str(port)]
            procs.append(subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        for node, p in enumerate(procs):
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                print(out[-4000:])
                fail(f"{spec}: node {node} exited {p.returncode}")
    else:
        p = subprocess.run([cli, "train", "configs/default.yaml", *args, "--nproc-per-node", str(world)],
                           cwd=src, env=env, capture_output=True, text=True)
        LAST_OUTPUT[0] = p.stdout + p.stderr
        if p.returncode != 0:
            print(p.stdout[-4000:])
            print(p.stderr[-4000:])
            fail(f"{spec}: shardtrain train exited {p.returncode}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(l) for l in f if '"loss"' in l and '"eval' not in l]
    if with_norms:
        return world, [r["loss"] for r in records], [r["grad_norm"] for r in records]
    return world, [r["loss"] for r in records]


def ref_train(src, hf_dir, out_dir, world, extra=(), with_norms=False, micro=MICRO):
    """`world`: the data-parallel ranks of the run compared with, and `micro`
    its micro-batch (they make the held-out rows)."""
    out = os.path.join(out_dir, "ref.json")
    weights = os.path.join(out_dir, "ref.safetensors")
    data = os.path.join(src, "data/corpus.txt")
    cached_ref([hf_dir, data], [out, weights], "train", hf_dir, "--steps", str(STEPS), "--data", data,
               "--block-size", str(BLOCK), "--global-batch", str(GLOBAL), "--micro", str(micro),
               "--eval-rows", str(micro * world), "--warmup", "2", "--out", out, "--out-weights", weights,
               *extra)
    with open(out) as f:
        result = json.load(f)
    if with_norms:
        return result["losses"], [r["grad_norm"] for r in result["steps"]], weights
    return result["losses"], weights


def compare_weights(ours_dir, theirs, initial_dir, tol, what):
    """Every exported tensor against the reference's: elementwise (fp32) or
    as each tensor's update from the initial weights (bf16)."""
    a = load_hf_dir(ours_dir)[1]
    b, _ = read_safetensors(theirs)
    if sorted(a) != sorted(b):
        fail(f"{what}: exported names differ: only ours {sorted(set(a) - set(b))}, "
             f"only the reference's {sorted(set(b) - set(a))}")
    initial = load_hf_dir(initial_dir)[1]
    for name in sorted(b):
        x, y = a[name].double(), b[name].double()
        if "update_rtol" in tol:
            if name.endswith("k_proj.bias"):
                continue
            if tol.get("skip_norm_weights") and name.endswith("norm.weight"):
                continue
            rel = float((x - y).norm() / (y - initial[name].double()).norm())
            if rel > tol["update_rtol"]:
                fail(f"{what}: {name}'s update differs from the reference's by {rel:.3f} of its norm "
                     f"(> {tol['update_rtol']})")
        elif float(((x - y).abs() - tol["param_atol"] - tol["param_rtol"] * y.abs()).max()) > 0:
            fail(f"{what}: {name} differs by {float((x - y).abs().max()):.3e} "
                 f"(atol {tol['param_atol']}, rtol {tol['param_rtol']})")


def check_losses(what, ours, theirs, first_step=1):
    """Each step's loss within the fp32 tolerance of the reference's."""
    for i, (o, r) in enumerate(zip(ours, theirs)):
        if abs(o - r) > FP32["loss"]:
            fail(f"{what}: step {i + first_step} loss {o:.7f}, reference {r:.7f}")


def check_norms(what, ours, theirs):
    """Each step's gradient norm before clipping: a parameter counted twice
    or missed (a replicated norm weight once per tensor-parallel rank) shows here."""
    for i, (o, r) in enumerate(zip(ours, theirs)):
        if abs(o - r) > FP32["norm_atol"] + FP32["norm_rtol"] * abs(r):
            fail(f"{what}: step {i + 1} gradient norm {o:.7f}, reference {r:.7f}")


def tp_auto_budget(cli, src, hf_dir, spec, sets):
    """A memory budget (MiB) between the totals `shardtrain estimate` gives
    the run's strategy at tensor_parallel 1 and 2: auto must pick 2."""
    world, all_sets = train_sets(hf_dir, "unused", spec, sets)
    args = [a for s in all_sets for a in ("--set", s)]
    out = run([cli, "estimate", "configs/default.yaml", *args, "--nproc-per-node", str(world)], "estimate", cwd=src)
    lines = out.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith("tensor parallelism: total per rank")), None)
    if start is None:
        fail(f"estimate printed no tensor parallelism table:\n{out}")
    head = lines[start + 1].split()
    column = head.index(all_sets[0].split("=")[1])  # distributed.strategy=ddp
    totals = {}
    for line in lines[start + 2:]:
        cells = [c.rstrip("*") for c in line.split("  ") if c.strip()]
        if not cells or not cells[0].strip().isdigit():
            break
        totals[int(cells[0])] = float(cells[column].split()[0])  # every total here is in MiB
    return (totals[1] + totals[2]) / 2


def cmd_train(cli, src, variant, spec, *options):
    precision = "bf16" if "bf16" in options or "bf16-true" in options else "fp32"
    sets = [o for o in options if "=" in o and not o.startswith(("+", "clip="))]
    make_args = [a for o in options if o.startswith("+") for a in o[1:].split("=", 1)]
    clip = [o.split("=", 1)[1] for o in options if o.startswith("clip=")]
    work = tempfile.mkdtemp(prefix="llama_parity_")
    try:
        hf = make_variant(work, variant, make_args)
        extra = ["precision=" + ("bf16-true" if "bf16-true" in options else "bf16-mixed" if precision == "bf16"
                                 else "fp32")]
        ref_extra = ["--autocast", "bf16"] if precision == "bf16" else []
        if clip:
            extra.append(f"trainer.max_grad_norm={clip[0]}")
            ref_extra += ["--max-grad-norm", clip[0]]
        if "distributed.tensor_parallel=auto" in sets:
            sets.append(f"distributed.memory_budget_mb={tp_auto_budget(cli, src, hf, spec, extra + sets)}")
        world, ours, our_norms = shardtrain_train(cli, src, hf, os.path.join(work, "run"), spec, extra + sets,
                                                  with_norms=True)
        # The degrees the run took (auto decides tp), as its config.yaml records them.
        with open(os.path.join(work, "run", "config.yaml")) as f:
            text = f.read()
        tp = int(re.search(r"^\s*tensor_parallel: (\d+)$", text, re.M).group(1))
        pp = int(re.search(r"^\s*pipeline_parallel: (\d+)$", text, re.M).group(1))
        if "distributed.tensor_parallel=auto" in sets and tp != 2:
            fail(f"tensor_parallel auto took {tp} under a budget only tensor_parallel 2 fits")
        micro = int(re.search(r"^\s*micro: (\d+)$", text, re.M).group(1))
        accumulate = GLOBAL // (micro * (world // (tp * pp)))
        warning = f"warning: batch.accumulate={accumulate} micro-batches for distributed.pipeline_parallel={pp}"
        if pp > 1 and accumulate < pp and warning not in LAST_OUTPUT[0]:
            fail(f"{accumulate} micro-batches through {pp} stages ran without the bubble warning")
        theirs, their_norms, weights = ref_train(src, hf, work, world // (tp * pp), ref_extra, with_norms=True,
                                                 micro=micro)
        what = " ".join([variant, spec] + list(options or ["fp32"]))
        tol = BF16_TRUE if "bf16-true" in options else BF16 if precision == "bf16" else FP32
        if len(ours) != STEPS:
            fail(f"{what}: {len(ours)} step losses in metrics.jsonl, expected {STEPS}")
        for i, (o, r) in enumerate(zip(ours, theirs)):
            bad = abs(o - r) > (tol["loss_rtol"] * abs(r) if precision == "bf16" else FP32["loss"])
            if bad:
                fail(f"{what}: step {i + 1} loss {o:.7f}, reference {r:.7f}")
        if precision == "fp32":
            check_norms(what, our_norms, their_norms)
            if clip and not min(their_norms) > float(clip[0]):
                fail(f"{what}: clipping at {clip[0]} did not fire on every step (norms {their_norms})")
        compare_weights(os.path.join(work, "run", "model"), weights, hf, tol, what)
        if "distributed.load_balance=measured" in sets:
            check_uneven(what, os.path.join(work, "run"))
        print(f"{what}: {STEPS} losses, gradient norms and the exported weights match the reference "
              f"(last loss {ours[-1]:.6f} vs {theirs[-1]:.6f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def layout(spec):
    """'full_shardx4:tp2:pp2' -> ('full_shardx4', its --set values, model-parallel ranks (tp x pp)).
    A dimension 'lb3-1' is measured load balancing starting from shares 3:1
    (re-planned every 2 steps)."""
    strategy, *dims = spec.split(":")
    sets, model_parallel = [], 1
    for d in dims:
        if d.startswith("lb"):
            sets += balance_sets(d[2:].split("-"))
            continue
        key = {"tp": "tensor_parallel", "pp": "pipeline_parallel"}[d[:2]]
        sets.append(f"distributed.{key}={d[2:]}")
        model_parallel *= int(d[2:])
    return strategy, sets, model_parallel


def balance_sets(shares):
    """Measured load balancing from `shares`, re-planned every 2 steps: the
    ranks compute uneven parts of each micro-step from the first step on."""
    return ["distributed.load_balance=measured", f"distributed.shares=[{','.join(shares)}]",
            "distributed.rebalance_every=2"]


def metrics_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def check_uneven(what, run_dir):
    """A load-balanced run really split its micro-steps unevenly."""
    if not any(len(set(r.get("samples_ranks", []))) > 1 for r in metrics_rows(run_dir)):
        fail(f"{what}: every step split its samples evenly (samples_ranks in metrics.jsonl)")


def cmd_reshard(cli, src, save_spec, *load_specs):
    """A checkpoint saved at step 5 under one (pp, tp, dp, strategy) layout
    resumes under others; every resumed run's steps 6..10 match the
    reference's 10 steps. Specs are STRATEGY[xN][:tpK][:ppJ]."""
    def parse(spec):
        strategy, sets, _ = layout(spec)
        return strategy, sets

    work = tempfile.mkdtemp(prefix="llama_parity_")
    try:
        # Four key/value heads, so that tp 4 splits them too.
        hf = make_variant(work, "gqa_llama3", ["--num_key_value_heads", "4"])
        # No held-out split: its rows depend on the data-parallel size, and
        # the runs compared here have different ones.
        theirs, _ = ref_train(src, hf, work, 1, ["--val-fraction", "0"])
        strategy, sets = parse(save_spec)
        saved = os.path.join(work, "saved")
        world, ours = shardtrain_train(cli, src, hf, saved, strategy,
                                       sets + ["precision=fp32", "data.val_fraction=0", "checkpoint.every_n_steps=5",
                                               "checkpoint.keep=0"])
        check_losses(f"reshard: saving run {save_spec}", ours, theirs)
        checkpoint = os.path.join(saved, "checkpoints", "step-000005")
        if not os.path.exists(os.path.join(checkpoint, "COMMITTED")):
            fail(f"reshard: {save_spec} wrote no committed checkpoint at {checkpoint}")
        for spec in load_specs:
            strategy, sets = parse(spec)
            resumed = os.path.join(work, "resumed-" + spec.replace(":", "-"))
            _, after = shardtrain_train(cli, src, hf, resumed, strategy,
                                        sets + ["precision=fp32", "data.val_fraction=0",
                                                f"checkpoint.resume={checkpoint}"])
            if len(after) != STEPS - 5:
                fail(f"reshard: {save_spec} -> {spec}: {len(after)} steps after resuming, expected {STEPS - 5}")
            check_losses(f"reshard: {save_spec} -> {spec}", after, theirs[5:], first_step=6)
            if "distributed.load_balance=measured" in sets and strategy_args(strategy)[0] == strategy_args(parse(save_spec)[0])[0]:
                # Measured shares continue where the checkpoint left them.
                with open(os.path.join(checkpoint, "train_state.bin")) as f:
                    saved_shares = json.load(f)["load_balance"]["shares"]
                first = metrics_rows(resumed)[0]["shares"]
                if any(abs(a - b) > 1e-6 for a, b in zip(first, saved_shares)) or len(first) != len(saved_shares):
                    fail(f"reshard: {save_spec} -> {spec}: step 6 ran with shares {first}, the checkpoint holds "
                         f"{saved_shares}")
            compare_weights(os.path.join(resumed, "model"), os.path.join(work, "ref.safetensors"), hf, FP32,
                            f"reshard {save_spec} -> {spec}")
            print(f"reshard: saved under {save_spec}, resumed under {spec}: steps 6..10 and the exported "
                  f"weights match the reference")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cmd_eval(cli, src, *specs):
    """Evaluation through a pipeline: the held-out loss every 5 steps under
    each SPEC (STRATEGY[xN][:tpK][:ppJ], one data-parallel rank) equals the
    one-process run's (its losses match the reference's in `train`), and
    metrics.jsonl carries each pipeline rank's busy and idle time and the
    bubble they make."""
    work = tempfile.mkdtemp(prefix="llama_parity_")
    try:
        hf = make_variant(work, "gqa_llama3")
        sets = ["trainer.eval_every=5", "trainer.eval_batches=2", "data.val_fraction=0.1"]

        def evals(spec):
            strategy, model_sets, _ = layout(spec)
            run_dir = os.path.join(work, "run-" + spec.replace(":", "-"))
            shardtrain_train(cli, src, hf, run_dir, strategy, sets + model_sets, steps=STEPS)
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                records = [json.loads(l) for l in f]
            return [r["eval_loss"] for r in records if "eval_loss" in r], [r for r in records if "loss" in r]

        want, _ = evals("single")
        if len(want) != 2:
            fail(f"eval: the one-process run logged {len(want)} evaluations, expected 2")
        for spec in specs:
            got, steps = evals(spec)
            if len(got) != len(want) or any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got, want)):
                fail(f"eval {spec}: held-out losses {got}, one process {want}")
            pp = int(spec.split(":pp")[1])
            for r in steps:
                busy, idle, bubble = r.get("pipeline_busy_s"), r.get("pipeline_idle_s"), r.get("pipeline_bubble")
                if busy is None or len(busy) != pp or len(idle) != pp or min(busy) <= 0 or min(idle) < 0:
                    fail(f"eval {spec}: step {r['step']} pipeline times {busy} / {idle}, expected {pp} ranks' each")
                # Idle time over busy time, as the schedules' simulator defines
                # it (the benchmark compares it with (p - 1) / m on a real model;
                # a model this small mostly waits on messages).
                if bubble is None or abs(bubble - sum(idle) / sum(busy)) > 1e-5 * max(1.0, bubble):
                    fail(f"eval {spec}: step {r['step']} bubble {bubble}, but the idle over busy times is "
                         f"{sum(idle) / sum(busy)}")
            print(f"eval {spec}: held-out losses {got} equal the one-process run's; pipeline times and bubble "
                  f"in every step's metrics (last bubble {steps[-1]['pipeline_bubble']:.3f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- masked instruction data, packed -------------------------------------------------------

def cmd_packed(cli, logits_bin, src, spec, *sets):
    """Prompt/completion records of very different lengths (prompt masked),
    packed several to a row: the micro-batches the task serves one process
    (rows, restarting positions, segments, masked targets) train the
    reference; shardtrain trains the same data under SPEC (STRATEGY[xN][:tpK][:ppJ]:
    one data-parallel rank, so the same batches) and SETS. Losses, gradient
    norms and the exported weights must match."""
    strategy, model_sets, model_parallel = layout(spec)
    work = tempfile.mkdtemp(prefix="llama_parity_")
    try:
        hf = make_variant(work, "gqa_llama3")
        data = os.path.join(work, "instructions.jsonl")
        with open(data, "w") as f:
            for i in range(120):
                answer = 26 if i % 9 == 0 else 1 + (i * 5) % 7
                f.write(json.dumps({"prompt": f"q{i % 37}? ", "completion": chr(97 + i % 11) * answer}) + "\n")
        data_sets = [f"data.train={data}", "data.packing=true", "data.val_fraction=0"]
        world, all_sets = train_sets(hf, os.path.join(work, "unused"), "single", data_sets + list(sets))
        batches = os.path.join(work, "batches.json")
        run([logits_bin, "batches", "configs/default.yaml", str(STEPS), batches, *all_sets], "batches", cwd=src)
        with open(batches) as f:
            served = json.load(f)
        packed_rows = sum(1 for step in served for m in step for row in m["segment"] if len(set(row)) > 2)
        masked = sum(1 for step in served for m in step for row in m["target"] for t in row if t == -100)
        if packed_rows == 0 or masked == 0:
            fail(f"packed: the batches hold {packed_rows} rows of several records and {masked} masked targets")
        world, ours, our_norms = shardtrain_train(cli, src, hf, os.path.join(work, "run"), strategy,
                                                  data_sets + model_sets + list(sets), with_norms=True)
        # The batches are one rank's; under measured load balancing several
        # data-parallel ranks split each of its micro-steps (the same rows).
        balanced = "distributed.load_balance=measured" in model_sets
        if world // model_parallel != 1 and not balanced:
            fail(f"packed: {spec} has {world // model_parallel} data-parallel ranks; the batches are one rank's")
        if balanced:
            check_uneven(f"packed {spec}", os.path.join(work, "run"))
        out = os.path.join(work, "ref.json")
        weights = os.path.join(work, "ref.safetensors")
        ref("train", hf, "--steps", str(STEPS), "--batches", batches, "--warmup", "2", "--out", out,
            "--out-weights", weights)
        with open(out) as f:
            result = json.load(f)
        theirs, their_norms = result["losses"], [r["grad_norm"] for r in result["steps"]]
        what = " ".join(["packed", spec] + list(sets))
        check_losses(what, ours, theirs)
        check_norms(what, our_norms, their_norms)
        compare_weights(os.path.join(work, "run", "model"), weights, hf, FP32, what)
        print(f"{what}: {STEPS} steps of packed masked rows ({packed_rows} rows of several records, "
              f"{masked} masked targets): losses, gradient norms and the exported weights match the reference")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- LoRA ---------------------------------------------------------------------------------

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def cmd_lora(cli, src, spec, *sets):
    """An adapter the reference writes (B non-zero, so its scale shows in the
    first step) trains 10 steps in both; shardtrain reads and writes the PEFT
    names, and its default targets are Llama's seven projections. SPEC is
    STRATEGY[xN][:tpK][:ppJ] (tensor parallelism splits the adapters with their
    layers; a pipeline's stages each hold their layers'); SETS are more config overrides."""
    strategy, model_sets, model_parallel = layout(spec)
    work = tempfile.mkdtemp(prefix="llama_parity_")
    try:
        hf = make_variant(work, "gqa_llama3")
        start = os.path.join(work, "start")
        ref("make-adapter", hf, start, "--r", "4", "--alpha", "8", "--seed", "5")
        run_dir = os.path.join(work, "run")
        world, ours = shardtrain_train(cli, src, hf, run_dir, strategy,
                                       ["lora.r=4", "lora.alpha=8", f"lora.init_from={start}"] + model_sets + list(sets))
        trained = os.path.join(work, "ref_adapter")
        theirs, _ = ref_train(src, hf, work, world // model_parallel, ["--adapter", start, "--out-adapter", trained])
        what = " ".join(["lora", spec] + list(sets))
        check_losses(what, ours, theirs)
        adapter = os.path.join(run_dir, "adapter")
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            config = json.load(f)
        for key, want in (("peft_type", "LORA"), ("task_type", "CAUSAL_LM"), ("fan_in_fan_out", False),
                          ("r", 4), ("lora_alpha", 8.0)):
            if config.get(key) != want:
                fail(f"{what}: adapter_config.json {key} is {config.get(key)!r}, expected {want!r}")
        if sorted(config.get("target_modules", [])) != sorted(PEFT_TARGETS):
            fail(f"{what}: target_modules {config.get('target_modules')}, expected Llama's {PEFT_TARGETS}")
        a, _ = read_safetensors(os.path.join(adapter, "adapter_model.safetensors"))
        b, _ = read_safetensors(os.path.join(trained, "adapter_model.safetensors"))
        example = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
        if example not in a or sorted(a) != sorted(b):
            fail(f"{what}: adapter names differ from PEFT's: only ours {sorted(set(a) - set(b))[:4]}, "
                 f"only the reference's {sorted(set(b) - set(a))[:4]}")
        for name in sorted(b):
            x, y = a[name].double(), b[name].double()
            if float(((x - y).abs() - FP32["param_atol"] - FP32["param_rtol"] * y.abs()).max()) > 0:
                fail(f"{what}: {name} differs by {float((x - y).abs().max()):.3e}")
        print(f"{what}: {len(a)} adapter tensors in PEFT names and {STEPS} losses match the reference "
              f"(last loss {ours[-1]:.6f} vs {theirs[-1]:.6f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cmd_lora_bias(cli, src):
    """lora.train_bias: all on the variant with every bias: the exported adapter,
    loaded with the base into the reference, gives the logits of the trained
    model (its merged export read by the reference). Without the biases in
    the adapter, base + adapter keeps the untrained biases."""
    work = tempfile.mkdtemp(prefix="llama_parity_")
    try:
        hf = make_variant(work, "biases")
        run_dir = os.path.join(work, "run")
        shardtrain_train(cli, src, hf, run_dir, "single",
                         ["lora.r=4", "lora.alpha=8", "lora.train_bias=all", "optimizer.lr=0.01"])
        adapter = os.path.join(run_dir, "adapter")
        tensors, _ = read_safetensors(os.path.join(adapter, "adapter_model.safetensors"))
        biases = [n for n in tensors if n.endswith(".bias")]
        if not biases:
            fail(f"lora bias=all: {adapter} holds no bias (names {sorted(tensors)[:4]}...)")
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3)).tolist()
        inputs = os.path.join(work, "in.json")
        with open(inputs, "w") as f:
            json.dump({"tokens": tokens}, f)
        got, want = os.path.join(work, "adapted.json"), os.path.join(work, "trained.json")
        ref("logits", hf, "--tokens", inputs, "--out", got, "--adapter", adapter)
        ref("logits", os.path.join(run_dir, "model"), "--tokens", inputs, "--out", want)
        base = os.path.join(work, "base.json")
        ref("logits", hf, "--tokens", inputs, "--out", base)
        with open(got) as f:
            g = json.load(f)["logits"]
        with open(want) as f:
            w = json.load(f)["logits"]
        with open(base) as f:
            b = json.load(f)["logits"]
        diff, moved = max_diff(g, w), max_diff(b, w)
        if moved < 1e-3 or diff > 1e-4:
            fail(f"lora bias=all: base + adapter differs from the trained model by {diff:.3e} "
                 f"(training moved the logits by {moved:.3e})")
        print(f"lora bias=all: {len(biases)} biases in the adapter; base + adapter in the reference gives "
              f"the trained logits within {diff:.2e} (training moved them by {moved:.2e})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- export, reload, generate ------------------------------------------------------------

def cmd_export(cli, src):
    work = tempfile.mkdtemp(prefix="llama_parity_")
    try:
        hf = make_variant(work, "tied_qwen2")
        run_dir = os.path.join(work, "run")
        # 20 kB shards: the tiny model's 0.4 MB go into many files.
        shardtrain_train(cli, src, hf, run_dir, "single", ["checkpoint.export_max_shard_mb=0.02"], steps=2)
        out = os.path.join(run_dir, "model")
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
        if len(files) < 3 or files[0] != f"model-00001-of-{len(files):05d}.safetensors":
            fail(f"export: expected shards model-00001-of-N.safetensors..., got {files}")
        for name in files:
            size = os.path.getsize(os.path.join(out, name))
            if size > 20000 + 4096 and len(read_safetensors(os.path.join(out, name))[0]) > 1:
                fail(f"export: {name} holds {size} bytes, more than the 20 kB cap allows")
        if os.path.exists(os.path.join(out, "model.safetensors")):
            fail("export: a sharded export also left model.safetensors")
        config, exported = load_hf_dir(out)
        with open(os.path.join(hf, "config.json")) as f:
            original = json.load(f)
        for key in ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rope_theta",
                    "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
            if config.get(key) != original.get(key):
                fail(f"export: config.json {key} is {config.get(key)!r}, the model's is {original.get(key)!r}")
        # The export is the final checkpoint's weights, bit for bit.
        consolidated = os.path.join(work, "consolidated.safetensors")
        run([cli, "checkpoint", "consolidate", run_dir, "--out", consolidated], "checkpoint consolidate")
        final, _ = read_safetensors(consolidated)
        if sorted(final) != sorted(exported):
            fail(f"export: names differ from the checkpoint's: {sorted(set(final) ^ set(exported))}")
        for name, t in final.items():
            if not torch.equal(t, exported[name]):
                fail(f"export: {name} differs from the final checkpoint's")
        # The reference reads the export and generates what `shardtrain
        # generate` does from it (greedy; the reference reports each choice's
        # margin over the runner-up, all far above rounding).
        prompt = os.path.join(work, "prompt.json")
        with open(prompt, "w") as f:
            json.dump([list(b"The ")], f)
        theirs = json.loads(ref("generate", out, "--tokens", prompt, "--max-new", "16"))
        p = subprocess.run([cli, "generate", "--checkpoint", out, "--prompt", "The ", "--max-new-tokens", "16",
                            "--temperature", "0"], capture_output=True)
        if p.returncode != 0:
            fail(f"generate from the export exited {p.returncode}: {p.stderr.decode(errors='replace')}")
        ours = list(p.stdout.rstrip(b"\n"))
        if ours != theirs["tokens"][0]:
            fail(f"generate: {ours} but the reference generates {theirs['tokens'][0]} "
                 f"(margins {theirs['margins']})")
        print(f"export: {len(files)} shards equal the final checkpoint bit for bit; the reference reads "
              f"them and generates the same {len(ours) - 4} tokens")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    cmd = argv[0]
    if cmd == "logits":
        cmd_logits(argv[1], argv[2])
    elif cmd == "packed":
        cmd_packed(argv[1], argv[2], argv[3], argv[4], *argv[5:])
    elif cmd == "lora":
        cmd_lora(argv[1], argv[2], argv[3], *argv[4:])
    elif cmd == "lora_bias":
        cmd_lora_bias(argv[1], argv[2])
    elif cmd == "export":
        cmd_export(argv[1], argv[2])
    elif cmd == "eval":
        cmd_eval(argv[1], argv[2], *argv[3:])
    elif cmd == "reshard":
        cmd_reshard(argv[1], argv[2], argv[3], *argv[4:])
    elif cmd == "train":
        cmd_train(argv[1], argv[2], argv[3], argv[4], *argv[5:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
