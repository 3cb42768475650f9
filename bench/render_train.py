#!/usr/bin/env python3
"""Records and renders bench/train.sh's results into BENCHMARKS.md (stdlib only).

bench/train.sh appends JSON lines to one results file, each with a "kind":
  render_train.py machine --json R --date .. --command .. --torch .. --load ..
      "machine": CPU model, family/model numbers, the ISA flags that matter
      (avx512f, avx512_bf16, amx_bf16, amx_tile), nproc, date, load before
  render_train.py peak --json R GEMM.json [GEMM2.json]
      "gemm_peak": bench/gemm_peak.cpp's output; with two files (two copies
      run at once) the per-copy mean
  render_train.py summarize --metrics RUN/metrics.jsonl --label gpt-25m --mode ddp ... --json R
      a throughput row ("impl":"shardtrain") for a `shardtrain train` run: the
      median step_time_s over the steps after the first --warmup, tokens/s
      from it, the largest peak_rss_mb (max over ranks, a running maximum),
      and blas_core / blas_threads when the metrics carry them.
      (bench/torch_gpt_ddp.py writes the PyTorch rows itself, "impl":"pytorch".)
  render_train.py skipped --json R --label .. --mode .. --reason ..
      "skipped": a mode this machine cannot run
  render_train.py finish --json R --elapsed S --load ..
      "finish": elapsed seconds, load after
  (bench/profile_breakdown.py appends the "profile" rows.)
  render_train.py coretype --metrics RUN/metrics.jsonl --default SKYLAKEX
      prints the OPENBLAS_CORETYPE value naming the kernels the run's ranks
      used (its "blas_core": SkylakeX -> SKYLAKEX, ...), --default when the
      metrics do not say, nothing when the BLAS is not OpenBLAS
  render_train.py render --results R --out BENCHMARKS.md
      replaces the text between <!-- train:begin --> and <!-- train:end --> in
      --out (appends the section when the markers are missing; creates the
      file when it does not exist). Text outside the markers is kept.
"""
import argparse
import os
import statistics
import sys

import benchlib

def markers(section):
    """The BENCHMARKS.md markers of a section: train (GPT) or train-llama."""
    return f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
MODEL_ORDER = ("gpt-25m", "gpt2-124m", "default")
# Mode name -> (text, the mode of PyTorch's row it is compared with).
MODES = {
    "ddp": ("fp32 DDP", "ddp"),
    "zero1": ("fp32 ZeRO-1", "zero1"),
    "fsdp": ("fp32 FULL_SHARD", "ddp"),
    "bf16-ddp": ("bf16-mixed DDP", "bf16-ddp"),
    "single": ("fp32 single process", "single"),
}
MODE_ORDER = tuple(MODES)
PEER_TEXT = {"ddp": "DDP", "zero1": "DDP + ZeroRedundancyOptimizer", "bf16-ddp": "DDP, bf16 autocast",
             "single": "one process"}
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


# ---- recording -------------------------------------------------------------------

def cpuinfo():
    """model name, cpu family, model and the flags of the first processor."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                info[k.strip()] = v.strip()
    except OSError:
        pass
    return info


def machine(a):
    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    benchlib.append_jsonl(a.json, {
        "kind": "machine", "date": a.date, "command": a.command, "torch": a.torch,
        "omp_wait_policy": a.omp_wait_policy, "load_before": a.load, "quick": a.quick == "1",
        "env_openblas_coretype": a.env_coretype,
        "nproc": os.cpu_count(), "cpu": info.get("model name", "unknown"),
        "cpu_family": info.get("cpu family", "?"), "cpu_model": info.get("model", "?"),
        "flags": {f: f in flags for f in CPU_FLAGS},
    })


def peak(a):
    runs = [benchlib.load_jsonl(p, "render_train.py")[-1] for p in a.files]
    n = len(runs)
    row = {"kind": "gemm_peak", "copies": n, "env": a.env,
           "blas_core": runs[0].get("blas_core", ""),
           "fp32_gflops": sum(r["fp32_gflops"] for r in runs) / n,
           "bf16_gflops": sum(r["bf16_gflops"] for r in runs) / n,
           "per_copy": [{"fp32_gflops": r["fp32_gflops"], "bf16_gflops": r["bf16_gflops"]} for r in runs],
           "reps": runs[0].get("reps"), "min_seconds": runs[0].get("min_seconds"),
           "shapes": runs[0].get("shapes", [])}
    benchlib.append_jsonl(a.json, row)


def summarize(a):
    steps = benchlib.load_jsonl(a.metrics, "render_train.py")
    if len(steps) <= a.warmup:
        sys.exit(f"render_train.py: {a.metrics} has {len(steps)} steps, need more than --warmup {a.warmup}")
    measured = [s["step_time_s"] for s in steps[a.warmup:]]
    last = steps[-1]
    step_time = statistics.median(measured)
    world = int(last["world_size"])
    row = {
        "impl": "shardtrain", "label": a.label, "mode": a.mode, "strategy": last["strategy"],
        "precision": last.get("precision", "fp32"), "world_size": world,
        "threads_per_rank": a.threads, "model": a.model_type, "n_layer": a.n_layer, "n_embd": a.n_embd,
        "block_size": a.block_size, "vocab_size": a.vocab_size,
        "num_parameters": last.get("num_parameters"),
        "global_batch": a.global_batch, "micro": a.micro, "accumulate": a.global_batch // (a.micro * world),
        "steps": len(steps), "measured_steps": len(measured),
        "step_time_s": step_time, "step_time_mean_s": statistics.mean(measured),
        "tokens_per_s": a.global_batch * a.block_size / step_time,
        "peak_rss_mb": max(s["peak_rss_mb"] for s in steps),
        "first_loss": steps[0]["loss"], "last_loss": last["loss"],
    }
    for k in ("blas_core", "blas_threads"):  # absent from older builds' metrics
        if k in last:
            row[k] = last[k]
    benchlib.append_jsonl(a.json, row)


def coretype(a):
    """OpenBLAS's OPENBLAS_CORETYPE matches core names without regard to case."""
    steps = benchlib.load_jsonl(a.metrics, "render_train.py")
    core = steps[-1].get("blas_core") if steps else None
    print(a.default if core is None else core.upper())


def skipped(a):
    benchlib.append_jsonl(a.json, {"kind": "skipped", "label": a.label, "mode": a.mode, "reason": a.reason})


def finish(a):
    benchlib.append_jsonl(a.json, {"kind": "finish", "elapsed_s": a.elapsed, "load_after": a.load})


# ---- rendering -------------------------------------------------------------------

def flops_per_token(r):
    """Training FLOPs per token: 6 x (non-embedding parameters + the tied output
    projection n_embd x vocab) + 3 x the forward attention matmuls (QK^T and
    AV: 2 x 2 x T x C per layer)."""
    c, t, l = r["n_embd"], r["block_size"], r["n_layer"]
    v = r.get("vocab_size", 256)
    if r.get("model") == "llama":  # no wpe; the untied lm_head is a GEMM like any other
        return 6 * (r["num_parameters"] - v * c) + 3 * (4 * t * c * l)
    non_embedding = r["num_parameters"] - v * c - t * c  # wte (tied, counted once) and wpe
    return 6 * (non_embedding + c * v) + 3 * (4 * t * c * l)


def peak_for(r, peaks):
    """GFLOP/s per core this row's fraction divides by: the per-copy figure of
    two concurrent copies for 2 ranks, one copy alone for 1; bf16 for bf16 rows."""
    key = "bf16_gflops" if str(r.get("precision", "fp32")).startswith("bf16") else "fp32_gflops"
    if not peaks:
        return None
    ranks = r["world_size"]
    p = peaks.get(ranks) or peaks[min(peaks, key=lambda n: abs(n - ranks))]
    return p[key]


def fraction(r, peaks):
    if not r.get("num_parameters") or "n_layer" not in r:
        return None
    p = peak_for(r, peaks)
    if not p:
        return None
    threads = r["world_size"] * r["threads_per_rank"]
    return r["tokens_per_s"] * flops_per_token(r) / (p * 1e9 * threads)


def pct(x):
    return "—" if x is None else f"{100 * x:.0f} %"


def yes(b):
    return "yes" if b else "no"


def mode_of(r):
    """A row's mode name; rows from before modes were recorded derive it."""
    if r.get("mode"):
        return r["mode"]
    s = r.get("strategy", "ddp")
    return ("bf16-" + s) if str(r.get("precision", "fp32")).startswith("bf16") else s


def order(keys):
    def k(key):
        label, mode = key
        return (MODEL_ORDER.index(label) if label in MODEL_ORDER else 99, label,
                MODE_ORDER.index(mode) if mode in MODE_ORDER else 99, mode)
    return sorted(keys, key=k)


def rounds_of(rows, impl):
    """(label, mode) -> that implementation's timed runs, in the order they ran (one per round)."""
    out = {}
    for r in rows:
        if r.get("impl") == impl and "step_time_s" in r:
            out.setdefault((r["label"], mode_of(r)), []).append(r)
    return out


def median_run(runs):
    """The run of median tokens/s (the lower of the middle two for an even count)."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2]


def spread(ours, theirs):
    """' (rounds: 1.10–1.25×)': the range of the per-round ratios, pairing the
    k-th run of each; empty for a single round."""
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)]
    if len(ratios) < 2:
        return ""
    return f" (rounds: {min(ratios):.2f}–{max(ratios):.2f}×)"


def render(rows, a):
    m = next((r for r in rows if r.get("kind") == "machine"), {})
    fin = next((r for r in rows if r.get("kind") == "finish"), {})
    peaks = {r["copies"]: r for r in rows if r.get("kind") == "gemm_peak"}
    st_rounds = rounds_of(rows, "shardtrain")
    pt_rounds = rounds_of(rows, "pytorch")
    st = {k: median_run(v) for k, v in st_rounds.items()}
    pt = {k: median_run(v) for k, v in pt_rounds.items()}
    skips = {(r["label"], r["mode"]): r for r in rows if r.get("kind") == "skipped"}
    profs = [r for r in rows if r.get("kind") == "profile"]
    if not st:
        sys.exit("render_train.py: no shardtrain results to render")
    mismatched = []
    keys = order({k for k in st if "@" not in k[1]} | set(skips))  # "ddp@fsdp": a peer run, no row

    flags = m.get("flags", {})
    st_cores = sorted({r.get("blas_core") for r in st.values() if r.get("blas_core") is not None})
    pt_cores = sorted({r.get("blas_core") for r in pt.values() if r.get("blas_core") is not None})
    pt_env = sorted({" ".join(f"{k}={v}" for k, v in sorted(r.get("env", {}).items())) for r in pt.values()})
    quick = m.get("quick")

    begin, end = markers(a.section)
    title = "Llama architecture" if a.section == "train-llama" else "GPT"
    out = [begin, "", f"## Training throughput (CPU, {title})", ""]
    if quick:
        out += ["**QUICK smoke run (QUICK=1): a few steps per run; these figures show that the script "
                "works, not how fast anything is.**", ""]
    out.append(f"- Run: {m.get('date', '?')}; `nproc` = {m.get('nproc', '?')}; CPU {m.get('cpu', '?')} "
               f"(cpu family {m.get('cpu_family', '?')}, model {m.get('cpu_model', '?')}); "
               + ", ".join(f"{f} {yes(flags.get(f))}" for f in CPU_FLAGS)
               + f"; PyTorch {m.get('torch', '?')} (Debian) as the peer.")
    ctx = []
    if fin.get("elapsed_s") is not None:
        ctx.append(f"measured in {fin['elapsed_s']} s")
    ctx.append(f"load average {m.get('load_before', '?')} before, {fin.get('load_after', '?')} after")
    out.append(f"- Command: `{m.get('command', '?')}` ({'; '.join(ctx)})")
    out.append("- OpenBLAS kernels: shardtrain's ranks "
               + (", ".join(c or "not OpenBLAS" for c in st_cores) if st_cores else "not reported by this build")
               + "; PyTorch's ranks " + (", ".join(c or "not OpenBLAS" for c in pt_cores) if pt_cores else "?")
               + "; gemm_peak " + (", ".join(sorted({p.get("blas_core") or "not OpenBLAS" for p in peaks.values()})) or "?")
               + f"; OPENBLAS_CORETYPE in the calling environment: "
               + f"{m.get('env_openblas_coretype', '?')}.")
    if peaks:
        parts = []
        for n in sorted(peaks):
            p = peaks[n]
            who = "one copy alone" if n == 1 else f"per copy, {n} copies at once"
            parts.append(f"{who}: fp32 {p['fp32_gflops']:.0f}, bf16 {p['bf16_gflops']:.0f} GFLOP/s")
        p0 = next(iter(peaks.values()))
        env = p0.get("env", "")
        out.append("- GEMM peak of one core (bench/gemm_peak.cpp: at::mm on 1 thread, OpenBLAS 1 thread"
                   + (f", {env}" if env else "") + "; squares 1024 and 2048 and the 512-token gpt-25m "
                   "shapes 512×512·512×1536, 512×512·512×2048, 512×2048·2048×512; "
                   f"the best of {p0.get('reps', '?')} timed runs of ≥ {p0.get('min_seconds', '?')} s each "
                   "after a warm-up, the best shape per dtype): " + "; ".join(parts) + ".")
    out.append(
        "- Method: `shardtrain train` against "
        + ("bench/torch_llama_ddp.py, the same Llama decoder (tests/reference/llama_ref.py: RMSNorm "
           "in fp32, rotate-half rotary, grouped-query attention, SwiGLU, untied head) "
           if a.section == "train-llama" else
           "bench/torch_gpt_ddp.py, the same GPT-2 model (pre-LN, fused c_attn, GELU tanh, tied "
           "wte, mask built per forward) ")
        + "with the same parameter count, byte data from data/corpus.txt, batch, AdamW (betas 0.9/0.95, decay on "
        "dim ≥ 2 only), clipping at 1.0, and 1 thread per rank everywhere. Peers: PyTorch "
        "DistributedDataParallel over Gloo with no_sync() on accumulation micro-steps; ZeRO-1 rows "
        "wrap AdamW in ZeroRedundancyOptimizer; bf16 rows run forward and loss under "
        "torch.autocast(\"cpu\", dtype=torch.bfloat16) against shardtrain's precision=bf16-mixed. "
        "FULL_SHARD (distributed.strategy=fsdp) has no PyTorch peer here: its ratio is against "
        "shardtrain's own fp32 DDP, run beside it in each round (goal ≥ 0.95×); PyTorch DDP is "
        "shown for reference. "
        "Peers run at their best known settings: "
        + (", ".join(f"`{e}`" for e in pt_env) if pt_env else "?")
        + " (OPENBLAS_CORETYPE = the kernel set shardtrain's run of the same mode reported, or "
        "SKYLAKEX on an AVX-512 CPU when it did not say: both programs multiply with the same "
        "kernels). "
        f"OMP_WAIT_POLICY={m.get('omp_wait_policy', '?')} for both. Each mode runs in "
        f"{max((len(v) for v in st_rounds.values()), default=1)} round(s), a round being one run of "
        "shardtrain and then one of its peer (FULL_SHARD: of shardtrain's DDP), so that both meet "
        "the same moment of a shared machine; a row shows the run of median tokens/s of each, "
        "their ratio, and the range of the per-round ratios. A step is timed from the first "
        "micro-batch to zero_grad on every rank and the slowest rank counts; a run's figure is the "
        "median over its measured steps. tokens/s = global batch × block size / step time. Ratio = "
        "shardtrain / PyTorch tokens/s (above 1: shardtrain faster). Peak "
        "RSS = ru_maxrss per rank, max over ranks (PyTorch's includes the Python interpreter). "
        "GEMM peak fraction = tokens/s × FLOPs per token / (per-core GEMM peak × ranks × threads), "
        "FLOPs per token = 6 × (non-embedding parameters + n_embd × vocab, the tied output "
        "projection) + 3 × 4 × T × C × L (forward attention QKᵀ and AV, 2 × 2 × T × C multiply-add "
        "FLOPs per layer per token; fwd + bwd = 3 × fwd); the peak is the fp32 or bf16 figure "
        "above, per copy of two concurrent copies for 2-rank rows (both ranks share the machine as "
        "the two copies do) and one copy alone for 1-process rows.")
    seen = []
    for k in keys:
        r = st.get(k)
        if not r or r["label"] in seen:
            continue
        seen.append(r["label"])
        out.append(f"- `{r['label']}`: {r.get('n_layer', '?')} layers, n_embd {r.get('n_embd', '?')}, "
                   f"block size {r['block_size']}, global batch {r['global_batch']} (micro {r['micro']}; "
                   f"accumulate {r['global_batch'] // r['micro']} on 1 process, "
                   f"{r['global_batch'] // (r['micro'] * 2)} per rank on 2), {r['steps']} steps, the last "
                   f"{r['measured_steps']} measured; {flops_per_token(r) / 1e6:.1f} MFLOP per token."
                   if r.get("num_parameters") and "n_layer" in r else
                   f"- `{r['label']}`: block size {r['block_size']}, global batch {r['global_batch']}, "
                   f"{r['steps']} steps, the last {r['measured_steps']} measured.")
    out.append("")
    out.append("| model | params | mode | shardtrain tokens/s | PyTorch tokens/s | shardtrain / PyTorch "
               "| shardtrain peak RSS/rank MB | PyTorch peak RSS/rank MB | GEMM peak fraction shardtrain "
               "| GEMM peak fraction PyTorch |")
    out.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for k in keys:
        label, mode = k
        text, peer_mode = MODES.get(mode, (mode, mode))
        s = st.get(k)
        if s is None:
            out.append(f"| {label} | | {text} | {skips[k]['reason']} | | | | | | |")
            continue
        ranks = s["world_size"]
        th = s["threads_per_rank"]
        text += (f", {ranks} ranks × {th} thread" if ranks > 1 else f", 1 process × {th} thread") \
            + ("s" if th != 1 else "")
        p = pt.get((label, peer_mode))
        params = benchlib.human_params(s["num_parameters"]) if s.get("num_parameters") else "?"
        if p and s.get("num_parameters") != p.get("num_parameters"):
            mismatched.append((k, s.get("num_parameters"), p.get("num_parameters")))
            params += " ≠ PyTorch " + benchlib.human_params(p["num_parameters"])
        # FULL_SHARD's peer: shardtrain's DDP run beside it in each round
        # (older results: the DDP row).
        ref = (label, "ddp@fsdp") if (label, "ddp@fsdp") in st else (label, "ddp")
        ours = st.get(ref) if mode == "fsdp" else None
        if ours:
            ratio = (f"{s['tokens_per_s'] / ours['tokens_per_s']:.2f}× of shardtrain DDP"
                     + spread(st_rounds[k], st_rounds[ref])
                     + (f" ({s['tokens_per_s'] / p['tokens_per_s']:.2f}× PyTorch DDP)" if p else ""))
            peer = f"{p['tokens_per_s']:,.0f} (DDP)" if p else "—"
        elif p:
            ratio = (f"{s['tokens_per_s'] / p['tokens_per_s']:.2f}×"
                     + spread(st_rounds[k], pt_rounds[(label, peer_mode)]))
            peer = f"{p['tokens_per_s']:,.0f}"
        else:
            ratio, peer = "—", "—"
        cols = [label, params, text, f"{s['tokens_per_s']:,.0f}", peer, ratio, f"{s['peak_rss_mb']:,.0f}",
                f"{p['peak_rss_mb']:,.0f}" if p else "—", pct(fraction(s, peaks)),
                pct(fraction(p, peaks)) if p else "—"]
        out.append("| " + " | ".join(cols) + " |")
    out += render_profiles(profs)
    out.append("")
    out.append(end)
    return "\n".join(out), mismatched


def render_profiles(profs):
    """The per-category table: a column pair (shardtrain / PyTorch ms) per mode."""
    if not profs:
        return []
    by = {(r["label"], r["mode"], r["impl"]): r for r in profs}
    modes = order({(r["label"], r["mode"]) for r in profs})
    cats = []
    for r in profs:
        for name, _ in r["categories"]:
            if name not in cats:
                cats.append(name)
    step = next((r.get("step") for r in profs if r.get("step") is not None), "?")
    out = ["", f"### Where a step goes (ms per optimizer step; rank 0; step {step} of a separate profiled run)",
           "",
           "Profiling method: separate short runs, never the timed ones (the profiler slows a step): "
           "shardtrain with `trainer.profile_step` (LibTorch's autograd profiler), PyTorch with "
           "`--profile-step` (torch.autograd.profiler.profile(), record_shapes off, record_function "
           "scopes forward / backward / clip / optimizer). An op's time is its exclusive (self) CPU "
           "time; bench/profile_breakdown.py sorts ops into the rows by name: GEMM = mm, addmm, bmm, "
           "baddbmm, matmul, linear (and mkldnn matmuls); attention softmax+mask = softmax and its "
           "backward, masked_fill, triu, ones, where, and shardtrain's fused causal attention "
           "(its softmax rows and the attention GEMMs it calls on the BLAS directly, which no "
           "profiler event separates: shardtrain's GEMM row holds the projections only); copies/casts/alloc = copy_, to, _to_copy, "
           "contiguous, clone, cat, empty*, zeros, zero_, fill_; optimizer and clip = the whole scope "
           "(step and zero_grad; the norm and scaling); comm wait = shardtrain's \"sync\" scope less "
           "the ops in it, plus c10d/gloo call time; not in any op = step time less all the rows "
           "above (framework and Python time, autograd-engine dispatch, and PyTorch DDP's all-reduce "
           "wait, which happens inside backward in no op). The rows add up to the profiled step time. "
           "FULL_SHARD's PyTorch column is PyTorch DDP's.",
           ""]
    head = ["category"]
    for label, mode in modes:
        text = MODES.get(mode, (mode,))[0]
        head.append(f"{label} {text}: shardtrain / PyTorch")
    out.append("| " + " | ".join(head) + " |")
    out.append("|---|" + "---:|" * len(modes))

    def cell(r, cat):
        if r is None:
            return "—"
        return next((f"{v:,.0f}" for n, v in r["categories"] if n == cat), "—")

    def pair(label, mode, f):
        peer_mode = MODES.get(mode, (mode, mode))[1]
        s, p = by.get((label, mode, "shardtrain")), by.get((label, peer_mode, "pytorch"))
        return f"{f(s)} / {f(p)}"

    for cat in cats:
        out.append(f"| {cat} | " + " | ".join(pair(l, md, lambda r: cell(r, cat)) for l, md in modes) + " |")
    out.append("| **step (profiled)** | " + " | ".join(
        pair(l, md, lambda r: "—" if r is None else f"**{r['step_ms']:,.0f}**") for l, md in modes) + " |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--metrics", required=True)
    s.add_argument("--label", required=True)
    s.add_argument("--mode", required=True)
    s.add_argument("--warmup", type=int, required=True)
    s.add_argument("--threads", type=int, required=True)
    s.add_argument("--global-batch", type=int, required=True)
    s.add_argument("--micro", type=int, required=True)
    s.add_argument("--block-size", type=int, required=True)
    s.add_argument("--n-layer", type=int, required=True)
    s.add_argument("--n-embd", type=int, required=True)
    s.add_argument("--model-type", default="gpt", choices=["gpt", "llama"])
    s.add_argument("--vocab-size", type=int, default=256)
    s.add_argument("--json", required=True)
    s = sub.add_parser("machine")
    s.add_argument("--json", required=True)
    s.add_argument("--date", required=True)
    s.add_argument("--command", required=True)
    s.add_argument("--torch", default="?")
    s.add_argument("--omp-wait-policy", default="unset (libgomp default)")
    s.add_argument("--load", default="?")
    s.add_argument("--quick", default="0")
    s.add_argument("--env-coretype", default="(unset)", help="OPENBLAS_CORETYPE in the environment")
    s = sub.add_parser("peak")
    s.add_argument("--json", required=True)
    s.add_argument("--env", default="", help="the environment gemm_peak ran with (text)")
    s.add_argument("files", nargs="+")
    s = sub.add_parser("coretype")
    s.add_argument("--metrics", required=True)
    s.add_argument("--default", default="")
    s = sub.add_parser("skipped")
    s.add_argument("--json", required=True)
    s.add_argument("--label", required=True)
    s.add_argument("--mode", required=True)
    s.add_argument("--reason", required=True)
    s = sub.add_parser("finish")
    s.add_argument("--json", required=True)
    s.add_argument("--elapsed", type=int, required=True)
    s.add_argument("--load", default="?")
    r = sub.add_parser("render")
    r.add_argument("--results", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--section", default="train", choices=["train", "train-llama"])
    a = ap.parse_args()

    if a.cmd != "render":
        {"summarize": summarize, "machine": machine, "peak": peak, "coretype": coretype,
         "skipped": skipped, "finish": finish}[a.cmd](a)
        return

    section, mismatched = render(benchlib.load_jsonl(a.results, "render_train.py"), a)
    benchlib.write_section(a.out, *markers(a.section), section, "render_train.py")
    print(section)
    print(f"wrote {a.out}")
    for k, ns, np_ in mismatched:
        print(f"render_train.py: {k[0]} {k[1]}: shardtrain has {ns} parameters, "
              f"PyTorch {np_}; the models differ", file=sys.stderr)
    if mismatched:
        sys.exit(1)


if __name__ == "__main__":
    main()
