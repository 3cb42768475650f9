#!/usr/bin/env python3
"""Summarises and renders bench/train.sh's results into BENCHMARKS.md (stdlib only).

  render_train.py summarize --metrics RUN/metrics.jsonl --label default --warmup 4 ... --json R
      appends one JSON line ("impl":"shardtrain") for a `shardtrain train` run:
      the median step_time_s over the steps after the first --warmup, tokens/s
      from it, and the last peak_rss_mb (max over ranks, a running maximum).
  render_train.py render --results R --out BENCHMARKS.md --date ... --command ...
      replaces the text between <!-- train:begin --> and <!-- train:end --> in
      --out, appends the section when the markers are missing, and creates the
      file (with a short header) when it does not exist. Text outside the
      markers is kept.
"""
import argparse
import statistics
import sys

import benchlib

BEGIN, END = "<!-- train:begin -->", "<!-- train:end -->"
MODEL_ORDER = ("default", "gpt-25m")


def summarize(a):
    steps = benchlib.load_jsonl(a.metrics, "render_train.py")
    if len(steps) <= a.warmup:
        sys.exit(f"render_train.py: {a.metrics} has {len(steps)} steps, need more than --warmup {a.warmup}")
    measured = [s["step_time_s"] for s in steps[a.warmup:]]
    last = steps[-1]
    step_time = statistics.median(measured)
    world = int(last["world_size"])
    row = {
        "impl": "shardtrain", "label": a.label, "strategy": last["strategy"], "world_size": world,
        "threads_per_rank": a.threads, "block_size": a.block_size,
        "num_parameters": last.get("num_parameters"),
        "global_batch": a.global_batch, "micro": a.micro, "accumulate": a.global_batch // (a.micro * world),
        "steps": len(steps), "measured_steps": len(measured),
        "step_time_s": step_time, "step_time_mean_s": statistics.mean(measured),
        "tokens_per_s": a.global_batch * a.block_size / step_time,
        "peak_rss_mb": max(s["peak_rss_mb"] for s in steps),
        "first_loss": steps[0]["loss"], "last_loss": last["loss"],
    }
    benchlib.append_jsonl(a.json, row)



def mode_text(r):
    if r["world_size"] == 1:
        t = r["threads_per_rank"]
        return f"single, 1 process × {t} thread{'s' if t != 1 else ''}"
    t = r["threads_per_rank"]
    return f"DDP, {r['world_size']} ranks × {t} thread{'s' if t != 1 else ''}"


def render(rows, a):
    st = {(r["label"], r["world_size"]): r for r in rows if r.get("impl") == "shardtrain"}
    pt = {(r["label"], r["world_size"]): r for r in rows if r.get("impl") == "pytorch"}
    if not st:
        sys.exit("render_train.py: no shardtrain results to render")
    mismatched = []
    keys = sorted(st, key=lambda k: (MODEL_ORDER.index(k[0]) if k[0] in MODEL_ORDER else 99, k[0], k[1]))

    out = [BEGIN, "", "## Training throughput (CPU, GPT, fp32)", ""]
    out.append(f"- Run: {a.date}; `nproc` = {a.nproc} ({a.cpu}); PyTorch {a.torch} (Debian) as the peer.")
    out.append(f"- Command: `{a.command}`" + (f" ({a.context})" if a.context else ""))
    out.append(
        "- Method: `shardtrain train` against bench/torch_gpt_ddp.py, the same GPT-2 model "
        "(pre-LN, fused c_attn, GELU tanh, tied wte, mask built per forward) with the same "
        "parameter count, byte data from data/corpus.txt, batch, AdamW (betas 0.9/0.95, decay on "
        "dim ≥ 2 only), clipping at 1.0 and threads per rank; PyTorch DDP is "
        "DistributedDataParallel over Gloo with no_sync() on accumulation micro-steps. Each row is "
        "one run of each; a step is timed from the first micro-batch to zero_grad on every rank and "
        "the slowest rank counts; the figure is the median over the measured steps. tokens/s = "
        "global batch × block size / step time. Ratio = shardtrain / PyTorch tokens/s (above 1: "
        "shardtrain faster). Peak RSS = ru_maxrss per rank, max over ranks (PyTorch's includes "
        "the Python interpreter and the torch module). "
        f"OMP_WAIT_POLICY={a.omp_wait_policy} for both (see bench/train.sh: with libgomp's spinning "
        "default, 2 threads on this shared 2-core machine are many times slower than 1).")
    seen = []
    for k in keys:
        r = st[k]
        if r["label"] in seen:
            continue
        seen.append(r["label"])
        out.append(f"- `{r['label']}`: block size {r['block_size']}, global batch {r['global_batch']} "
                   f"(micro {r['micro']}; accumulate {r['global_batch'] // r['micro']} on 1 process, "
                   f"{r['global_batch'] // (r['micro'] * 2)} per rank on 2), {r['steps']} steps, "
                   f"the last {r['measured_steps']} measured.")
    out.append("")
    out.append("| model | params | mode | shardtrain tokens/s | PyTorch tokens/s | shardtrain / PyTorch "
               "| shardtrain peak RSS/rank MB | PyTorch peak RSS/rank MB |")
    out.append("|---|---:|---|---:|---:|---:|---:|---:|")
    for k in keys:
        s, p = st[k], pt.get(k)
        params = benchlib.human_params(s["num_parameters"]) if s.get("num_parameters") else "?"
        if p and s.get("num_parameters") != p.get("num_parameters"):
            mismatched.append((k, s.get("num_parameters"), p.get("num_parameters")))
            params += " ≠ PyTorch " + benchlib.human_params(p["num_parameters"])
        if p:
            cols = [f"{p['tokens_per_s']:,.0f}", f"{s['tokens_per_s'] / p['tokens_per_s']:.2f}×",
                    f"{s['peak_rss_mb']:,.0f}", f"{p['peak_rss_mb']:,.0f}"]
        else:
            cols = ["—", "—", f"{s['peak_rss_mb']:,.0f}", "—"]
        out.append(f"| {s['label']} | {params} | {mode_text(s)} | {s['tokens_per_s']:,.0f} | " + " | ".join(cols) + " |")
    out.append("")
    out.append(END)
    return "\n".join(out), mismatched


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--metrics", required=True)
    s.add_argument("--label", required=True)
    s.add_argument("--warmup", type=int, required=True)
    s.add_argument("--threads", type=int, required=True)
    s.add_argument("--global-batch", type=int, required=True)
    s.add_argument("--micro", type=int, required=True)
    s.add_argument("--block-size", type=int, required=True)
    s.add_argument("--json", required=True)
    r = sub.add_parser("render")
    r.add_argument("--results", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--date", required=True)
    r.add_argument("--nproc", type=int, required=True)
    r.add_argument("--cpu", default="unknown CPU")
    r.add_argument("--torch", default="?")
    r.add_argument("--command", required=True)
    r.add_argument("--omp-wait-policy", default="unset (libgomp default)")
    r.add_argument("--context", default="", help="free text shown after the command (timing, load)")
    a = ap.parse_args()

    if a.cmd == "summarize":
        summarize(a)
        return

    section, mismatched = render(benchlib.load_jsonl(a.results, "render_train.py"), a)
    benchlib.write_section(a.out, BEGIN, END, section, "render_train.py")
    print(section)
    print(f"wrote {a.out}")
    for k, ns, np_ in mismatched:
        print(f"render_train.py: {k[0]} at world size {k[1]}: shardtrain has {ns} parameters, "
              f"PyTorch {np_}; the models differ", file=sys.stderr)
    if mismatched:
        sys.exit(1)


if __name__ == "__main__":
    main()
