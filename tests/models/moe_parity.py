#!/usr/bin/python3
"""The mixture-of-experts families (mixtral, qwen3_moe) against an
independent implementation (tests/reference/moe_ref.py), on random tiny
Hugging Face directories the reference writes:

    moe_parity.py logits LOGITS_BIN SRC
        logits of every variant (full forward with a packed row, and the
        key/value-cached forward one token at a time) within 1e-5 of the
        reference's
    moe_parity.py train CLI SRC CASE...
        10 training steps through `shardtrain train` against the reference's
        loop on the same batches, for each CASE = VARIANT:STRATEGY[xN][:aux]:
        the per-step losses, aux_loss (the load-balancing loss, logged apart)
        and gradient norms, and the exported weights. `aux` turns on
        output_router_logits (the aux loss trains, coefficient 0.02); without
        it the coefficient is 0 and aux_loss is only logged. A CASE
        refused:KEY=VALUE (distributed.tensor_parallel=2, ...) must be a
        configuration error saying that it is not supported yet.

Every command exits 0 when all checks pass, 1 naming the first that failed.
Run with the system Python (Debian's python3-torch).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REF = os.path.join(HERE, "..", "reference", "moe_ref.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
from llama_parity import FP32, compare_weights, fail, max_diff, run, train_sets  # noqa: E402

# The variants. Each covers what the others do not:
#   mixtral: every layer sparse, top-2 of 4 renormalised, GQA (2 kv heads);
#   qwen3_norm: Qwen3's per-head q/k norms, head_dim 12 != hidden / heads,
#     norm_topk_prob true;
#   qwen3_dense: norm_topk_prob false, 4 layers with decoder_sparse_step 2
#     (layers 1 and 3 sparse) and mlp_only_layers [3]: only layer 1 is sparse,
#     the others dense MLPs of intermediate_size 24 (the experts' is 16);
#   mixtral_dead: 5 experts whose routers are [v, -v, w, -w, 0], so expert 4
#     never receives a token (its gradients are zeros, nothing hangs).
VARIANTS = {
    "mixtral": ["--model_type", "mixtral"],
    "qwen3_norm": ["--model_type", "qwen3_moe"],
    "qwen3_dense": ["--model_type", "qwen3_moe", "--norm_topk_prob", "false", "--num_hidden_layers", "4",
                    "--decoder_sparse_step", "2", "--mlp_only_layers", "[3]"],
    "mixtral_dead": ["--model_type", "mixtral", "--dead_expert", "true"],
}

STEPS = 10
BLOCK = 32
GLOBAL = 8
MICRO = 2


def ref(*args):
    return run([sys.executable, REF, *args], "moe_ref.py " + args[0])


def make_variant(work, name, extra=()):
    path = os.path.join(work, name)
    ref("make", path, *VARIANTS[name], *extra)
    return path


# ---- logits ------------------------------------------------------------------------------

def cmd_logits(logits_bin, src):
    work = tempfile.mkdtemp(prefix="moe_parity_")
    try:
        gen = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, 256, (2, 20), generator=gen).tolist()
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

def metrics_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if '"loss"' in l and '"eval' not in l]


# The config.json keys an exported directory must carry over for the
# reference (and transformers) to build the same model.
EXPORTED_KEYS = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                 "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits", "num_local_experts",
                 "num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                 "mlp_only_layers", "head_dim", "tie_word_embeddings"]


def check_exported_config(exported, initial, case):
    """RUN_DIR/model's config.json describes the model the reference made,
    and the reference builds and loads it."""
    with open(os.path.join(exported, "config.json")) as f:
        ours = json.load(f)
    with open(os.path.join(initial, "config.json")) as f:
        theirs = json.load(f)
    for key in EXPORTED_KEYS:
        if key in theirs and ours.get(key) != theirs[key]:
            fail(f"{case}: the exported config.json has {key}={ours.get(key)!r}, the model's is {theirs[key]!r}")
    from moe_ref import load_model
    load_model(exported)


def train_case(cli, src, work, case):
    variant, spec, *flags = case.split(":")
    aux = "aux" in flags
    hf = make_variant(work, variant, ["--output_router_logits", "true" if aux else "false"])
    run_dir = os.path.join(work, "run")
    world, sets = train_sets(hf, run_dir, spec, ["precision=fp32"])
    args = [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDTRAIN_TIMEOUT_S="120")
    run([cli, "train", "configs/default.yaml", *args, "--nproc-per-node", str(world)], f"{case}: shardtrain train",
        env=env, cwd=src)
    rows = metrics_rows(run_dir)
    out = os.path.join(work, "ref.json")
    weights = os.path.join(work, "ref.safetensors")
    ref("train", hf, "--steps", str(STEPS), "--data", os.path.join(src, "data/corpus.txt"),
        "--block-size", str(BLOCK), "--global-batch", str(GLOBAL), "--micro", str(MICRO),
        "--eval-rows", str(MICRO * world), "--warmup", "2", "--out", out, "--out-weights", weights)
    with open(out) as f:
        theirs = json.load(f)["steps"]
    if len(rows) != STEPS:
        fail(f"{case}: {len(rows)} step rows in metrics.jsonl, expected {STEPS}")
    for i, (o, r) in enumerate(zip(rows, theirs)):
        if abs(o["loss"] - r["loss"]) > FP32["loss"]:
            fail(f"{case}: step {i + 1} loss {o['loss']:.7f}, reference {r['loss']:.7f}")
        if "aux_loss" not in o or abs(o["aux_loss"] - r["aux_loss"]) > FP32["loss"]:
            fail(f"{case}: step {i + 1} aux_loss {o.get('aux_loss')}, reference {r['aux_loss']:.7f}")
        if abs(o["grad_norm"] - r["grad_norm"]) > FP32["norm_atol"] + FP32["norm_rtol"] * abs(r["grad_norm"]):
            fail(f"{case}: step {i + 1} gradient norm {o['grad_norm']:.7f}, reference {r['grad_norm']:.7f}")
    compare_weights(os.path.join(run_dir, "model"), weights, hf, FP32, case)
    check_exported_config(os.path.join(run_dir, "model"), hf, case)
    return rows[-1]["loss"], theirs[-1]["loss"], rows[-1]["aux_loss"]


def refused(cli, src, work, case):
    """`refused:KEY=VALUE`: a run of the mixtral variant with KEY=VALUE is a
    configuration error naming what is not supported yet, before any rank starts."""
    setting = case.split(":", 1)[1]
    hf = make_variant(work, "mixtral")
    world, sets = train_sets(hf, os.path.join(work, "run"), "ddpx2", [setting])
    args = [a for s in sets for a in ("--set", s)]
    p = subprocess.run([cli, "train", "configs/default.yaml", *args, "--nproc-per-node", str(world)],
                       cwd=src, capture_output=True, text=True, timeout=120)
    if p.returncode == 0 or "does not support" not in p.stderr or "configuration error" not in p.stderr:
        fail(f"{case}: expected a configuration error saying it is not supported yet, got exit "
             f"{p.returncode}: {p.stderr[-500:]}")
    print(f"{case}: refused: {p.stderr.strip().splitlines()[-1]}")


def cmd_train(cli, src, *cases):
    for case in cases:
        if case.startswith("refused:"):
            work = tempfile.mkdtemp(prefix="moe_parity_")
            try:
                refused(cli, src, work, case)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            continue
        work = tempfile.mkdtemp(prefix="moe_parity_")
        try:
            start = time.time()
            ours, theirs, aux = train_case(cli, src, work, case)
            print(f"{case}: {STEPS} losses, aux losses, gradient norms and the exported weights match "
                  f"(last loss {ours:.6f} vs {theirs:.6f}, aux {aux:.6f}; {time.time() - start:.1f} s)")
        finally:
            shutil.rmtree(work, ignore_errors=True)


def main():
    cmds = {"logits": cmd_logits, "train": cmd_train}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        sys.exit(__doc__)
    cmds[sys.argv[1]](*sys.argv[2:])


if __name__ == "__main__":
    main()
