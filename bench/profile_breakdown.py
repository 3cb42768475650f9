#!/usr/bin/env python3
"""Reduces per-rank step profiles to a per-category breakdown, in ms per step (stdlib only).

  profile_breakdown.py RUN/profile-rank0.json [MORE.json ...]
      prints each file's breakdown
  profile_breakdown.py FILES... --json RESULTS --mode "fp32 DDP 2x1" --label gpt-25m
      also appends one JSON line ("kind":"profile") per implementation to
      RESULTS, averaged over the files of that implementation (e.g. the ranks),
      which bench/render_train.py renders

Input: the format shardtrain's trainer.profile_step and bench/torch_gpt_ddp.py
--profile-step both write:

  {"impl":"shardtrain"|"pytorch","step":N,"rank":R,"step_us":..,
   "scopes":[{"name":"forward"|"backward"|"sync"|"clip"|"optimizer","total_us":..}],
   "ops":[{"name":"aten::addmm","scope":"forward"|..|"other","self_us":..,"calls":..}]}

Categories (CATEGORIES below, in this order), which add up to step_us:
  optimizer, clip    the whole scope's time (its total_us, framework time in it
                     included; the sum of its ops' self time when the scope is
                     missing)
  comm wait          the "sync" scope's total minus the self time of the ops
                     inside it (those count by name, below), plus the self
                     time of collective calls (c10d::*, gloo:*) anywhere
                     outside optimizer and clip; PyTorch DDP waits for its
                     all-reduce inside backward, in no op, so its wait is in
                     "not in any op" and only its calls are here
  GEMM, attention softmax+mask, LayerNorm, GELU, copies/casts/alloc, other ops
                     the exclusive (self) time of the ops outside optimizer and
                     clip, by name (OP_CATEGORIES)
  not in any op      step_us minus all of the above: the framework's own time
                     (Python, the autograd engine, DDP's reducer, the
                     profiler's wrappers such as "autograd::engine::
                     evaluate_function: ...", "AddmmBackward0" or
                     "DistributedDataParallel.forward", whose self time is
                     dispatch, not work) and, for PyTorch DDP, the all-reduce wait
Ops in scope "background" (run on another thread, e.g. communication,
overlapping the step) are shown in a row of their own, outside the sum.
Missing scopes and unknown op names are tolerated (unknown ops: other ops).
"""
import argparse
import json
import re
import sys

CATEGORIES = ("GEMM", "attention softmax+mask", "LayerNorm", "GELU", "copies/casts/alloc",
              "other ops", "optimizer", "clip", "comm wait", "not in any op")

# Ops a profile puts in scope "background" ran on other threads (a
# communication thread) alongside the step: shown, not added to the step.
BACKGROUND = "background threads (overlapped, not in the sum)"

# Exact op names (namespace stripped) per category. shardtrain's fused
# causal_attention calls the BLAS itself: its self time holds the attention
# GEMMs as well as the softmax rows.
OP_CATEGORIES = {
    "GEMM": {"mm", "addmm", "bmm", "baddbmm", "baddbmm_", "addbmm", "matmul", "linear", "mv", "addmv", "dot",
             "mkldnn_matmul", "mkldnn_linear", "_mkldnn_linear", "mkldnn_linear_backward",
             "mkldnn_linear_backward_input", "mkldnn_linear_backward_weights", "_addmm_activation"},
    "attention softmax+mask": {"softmax", "_softmax", "_softmax_backward_data", "causal_attention",
                               "causal_attention_backward",
                               "masked_fill", "masked_fill_", "triu", "tril", "ones", "where",
                               "_masked_softmax", "_masked_softmax_backward"},
    "LayerNorm": {"native_layer_norm", "native_layer_norm_backward", "layer_norm"},
    "GELU": {"gelu", "gelu_backward", "gelu_"},
    "copies/casts/alloc": {"copy_", "to", "_to_copy", "contiguous", "clone", "cat", "empty_like",
                           "empty", "empty_strided", "zeros", "zeros_like", "zero_", "fill_",
                           "new_empty", "new_empty_strided", "new_zeros", "resize_", "_copy_from",
                           "_copy_from_and_resize", "index_select", "stack"},
}

# Profiler events that wrap other ops rather than being ops: their self time
# is dispatch and bookkeeping, counted in "not in any op".
WRAPPER_PREFIXES = ("autograd::engine::", "torch::autograd::", "Optimizer.", "DistributedDataParallel.",
                    "torch.distributed.ddp.", "## ", "ProfilerStep", "forward", "backward", "sync",
                    "clip", "optimizer", "record_param_comms")
WRAPPER_RE = re.compile(r"Backward\d*$")  # autograd nodes: AddmmBackward0, ...
# Collective calls (enqueueing the work; Gloo runs it on its own threads):
# counted with the communication wait.
COMM_PREFIXES = ("c10d::", "gloo:", "nccl:")


def op_category(name):
    base = name.split("::", 1)[1] if "::" in name else name
    for cat, names in OP_CATEGORIES.items():
        if base in names:
            return cat
    if "mkldnn" in base and ("matmul" in base or "linear" in base):
        return "GEMM"
    return "other ops"


def is_wrapper(name):
    return name.startswith(WRAPPER_PREFIXES) or bool(WRAPPER_RE.search(name))


def breakdown(prof):
    """{category: ms} for one profile; the values add up to step_us / 1000."""
    scopes = {}
    for s in prof.get("scopes", []):
        scopes[s["name"]] = scopes.get(s["name"], 0.0) + float(s.get("total_us", 0.0))
    us = dict.fromkeys(CATEGORIES, 0.0)
    in_scope = {"optimizer": 0.0, "clip": 0.0, "sync": 0.0}
    background = 0.0
    for op in prof.get("ops", []):
        scope, self_us = op.get("scope", "other"), float(op.get("self_us", 0.0))
        if scope == "background":
            background += self_us
            continue
        if scope in ("optimizer", "clip"):
            in_scope[scope] += self_us
            continue
        if is_wrapper(op["name"]):
            continue
        if scope == "sync":
            in_scope["sync"] += self_us
        if op["name"].startswith(COMM_PREFIXES):
            us["comm wait"] += self_us
        else:
            us[op_category(op["name"])] += self_us
    for s in ("optimizer", "clip"):
        us[s] = scopes.get(s, in_scope[s])
    if "sync" in scopes:
        us["comm wait"] += max(0.0, scopes["sync"] - in_scope["sync"])
    step_us = float(prof["step_us"])
    us["not in any op"] = step_us - sum(v for k, v in us.items() if k != "not in any op")
    out = {k: v / 1000.0 for k, v in us.items()}
    if background:
        out[BACKGROUND] = background / 1000.0
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", default="", help="append one line per implementation to this results file")
    ap.add_argument("--mode", default="", help="the mode the profile is of (a column of the table)")
    ap.add_argument("--label", default="", help="the model label")
    a = ap.parse_args()

    by_impl = {}
    for path in a.files:
        try:
            with open(path) as f:
                prof = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"profile_breakdown.py: {path}: {e}")
        for key in ("impl", "step_us"):
            if key not in prof:
                sys.exit(f"profile_breakdown.py: {path}: no \"{key}\"; is it a step profile?")
        b = breakdown(prof)
        print(f"{path}: {prof['impl']} step {prof.get('step', '?')} rank {prof.get('rank', '?')}: "
              f"{prof['step_us'] / 1000.0:.1f} ms")
        for k in b:
            print(f"  {k:24s} {b[k]:9.1f} ms")
        by_impl.setdefault(prof["impl"], []).append((prof, b))

    if a.json:
        for impl, runs in by_impl.items():
            n = len(runs)
            row = {"kind": "profile", "impl": impl, "label": a.label, "mode": a.mode,
                   "step": runs[0][0].get("step"), "ranks": sorted(p.get("rank", 0) for p, _ in runs),
                   "step_ms": sum(p["step_us"] for p, _ in runs) / n / 1000.0,
                   "categories": [[k, sum(b.get(k, 0.0) for _, b in runs) / n]
                                  for k in CATEGORIES + ((BACKGROUND,) if any(BACKGROUND in b for _, b in runs) else ())]}
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
