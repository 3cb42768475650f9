#!/usr/bin/python3
"""The GPT family against an independent implementation.

shardtrain's GPT decoder, its safetensors loading and export and its
trainer are compared with tests/reference/gpt_ref.py, a PyTorch
implementation written from the architecture's definition, on random tiny
weights that the reference writes:

    gpt_parity.py train CLI SRC STRATEGY[xN] [KEY=VALUE ...]
        10 training steps through `shardtrain train` (launcher, data sampler,
        strategy, exporter) against the reference's loop on the same batches:
        the per-step losses and gradient norms, and the exported weights.
        STRATEGY[xN] as llama_parity.py's (single, ddpx2, zero1x2,
        full_shardx4, ...; not hybrid_shard); KEY=VALUE are config overrides
        (distributed.tensor_parallel=2: the tensor-parallel layouts;
        distributed.pipeline_parallel=2: stages, the tied head across them)

Exits 0 when all checks pass, 1 naming the first that failed.
Run with the system Python (Debian's python3-torch).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REF = os.path.join(HERE, "..", "reference", "gpt_ref.py")
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
sys.path.insert(0, HERE)
from llama_ref import read_safetensors  # noqa: E402
# One meaning of a strategy spec and one set of fp32 tolerances for every
# family's parity (llama_parity.py says how they were measured).
from llama_parity import FP32, fail, run, strategy_args  # noqa: E402

# Small enough for 10 steps in seconds; 4 heads split over tp 2. Every
# projection but attn.c_proj is non-square, so one loaded or exported
# without its Conv1D transpose fails on its shape; attn.c_proj fails on
# its values.
MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32, "vocab_size": 256}
STEPS = 10
GLOBAL = 8
MICRO = 2


def ref(*args):
    return run([sys.executable, REF, *args], "gpt_ref.py " + args[0])


def shardtrain_train(cli, src, weights, run_dir, spec, extra_sets):
    """Per-step (losses, gradient norms) of a run from `weights`."""
    world, sets = strategy_args(spec)
    if spec.startswith("hybrid_shard"):
        fail(f"{spec}: hybrid_shard needs two launchers; llama_parity.py covers it")
    sets = sets + [f"model.{k}={v}" for k, v in MODEL.items()] + [
        "model.type=gpt", f"model.init_from={weights}",
        f"batch.global={GLOBAL}", f"batch.micro={MICRO}", "batch.accumulate=null",
        f"trainer.max_steps={STEPS}", "trainer.eval_every=0", "trainer.sample_tokens=0",
        "trainer.progress=none", "distributed.threads_per_rank=1", "schedule.warmup_steps=2",
        "precision=fp32", f"run.dir={run_dir}", "data.train=data/corpus.txt",
    ] + list(extra_sets)
    args = [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDTRAIN_TIMEOUT_S="120")
    cmd = [cli, "train", "configs/default.yaml", *args, "--nproc-per-node", str(world)]
    p = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-4000:])
        print(p.stderr[-4000:])
        fail(f"{spec}: shardtrain train exited {p.returncode}: {' '.join(cmd)}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(l) for l in f if '"loss"' in l and '"eval' not in l]
    return world, [r["loss"] for r in records], [r["grad_norm"] for r in records]


def cmd_train(cli, src, spec, *sets):
    work = tempfile.mkdtemp(prefix="gpt_parity_")
    try:
        weights = os.path.join(work, "init.safetensors")
        ref("make", weights, *[a for k, v in MODEL.items() for a in (f"--{k}", str(v))], "--seed", "0")
        run_dir = os.path.join(work, "run")
        world, ours, our_norms = shardtrain_train(cli, src, weights, run_dir, spec, sets)
        # The held-out split is micro x data-parallel ranks rows; the ranks
        # of one tensor-parallel group and of one pipeline read the same rows.
        model_parallel = 1
        for key in ("distributed.tensor_parallel=", "distributed.pipeline_parallel="):
            model_parallel *= int(next((s.split("=")[1] for s in sets if s.startswith(key)), 1))
        out, theirs_file = os.path.join(work, "ref.json"), os.path.join(work, "ref.safetensors")
        ref("train", weights, "--steps", str(STEPS), "--data", os.path.join(src, "data/corpus.txt"),
            "--block-size", str(MODEL["block_size"]), "--global-batch", str(GLOBAL), "--micro", str(MICRO),
            "--eval-rows", str(MICRO * (world // model_parallel)), "--warmup", "2", "--out", out, "--out-weights", theirs_file)
        with open(out) as f:
            result = json.load(f)
        theirs, their_norms = result["losses"], [r["grad_norm"] for r in result["steps"]]
        what = " ".join(["gpt", spec] + list(sets))
        if len(ours) != STEPS:
            fail(f"{what}: {len(ours)} step losses in metrics.jsonl, expected {STEPS}")
        for i, (o, r) in enumerate(zip(ours, theirs)):
            if abs(o - r) > FP32["loss"]:
                fail(f"{what}: step {i + 1} loss {o:.7f}, reference {r:.7f}")
        # The norm before clipping: a parameter counted twice or missed (a
        # replicated LayerNorm or bias once per tensor-parallel rank) shows here.
        for i, (o, r) in enumerate(zip(our_norms, their_norms)):
            if abs(o - r) > FP32["norm_atol"] + FP32["norm_rtol"] * abs(r):
                fail(f"{what}: step {i + 1} gradient norm {o:.7f}, reference {r:.7f}")
        # The export keeps the file layout (Conv1D weights [in, out]): the
        # reference writes the same, so names, shapes and values compare as they are.
        a, _ = read_safetensors(os.path.join(run_dir, "model", "model.safetensors"))
        b, _ = read_safetensors(theirs_file)
        if sorted(a) != sorted(b):
            fail(f"{what}: exported names differ: only ours {sorted(set(a) - set(b))}, "
                 f"only the reference's {sorted(set(b) - set(a))}")
        for name in sorted(b):
            x, y = a[name].double(), b[name].double()
            if x.shape != y.shape:
                fail(f"{what}: exported {name} has shape {list(x.shape)}, the reference's {list(y.shape)}")
            if float(((x - y).abs() - FP32["param_atol"] - FP32["param_rtol"] * y.abs()).max()) > 0:
                fail(f"{what}: {name} differs by {float((x - y).abs().max()):.3e} "
                     f"(atol {FP32['param_atol']}, rtol {FP32['param_rtol']})")
        print(f"{what}: {STEPS} losses, gradient norms and the exported weights match the reference "
              f"(last loss {ours[-1]:.6f} vs {theirs[-1]:.6f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv):
    if len(argv) < 4 or argv[0] != "train":
        sys.exit(__doc__)
    torch.set_num_threads(1)
    cmd_train(argv[1], argv[2], argv[3], *argv[4:])


if __name__ == "__main__":
    main(sys.argv[1:])
