#!/usr/bin/env python3
"""Summarises and renders bench/sharding.sh's results into BENCHMARKS.md (stdlib only).

  render_sharding.py summarize --metrics RUN/metrics.jsonl --world 2 --mode zero1 --warmup 3 ... --json R
      appends one JSON line ("impl":"shardtrain") for a `shardtrain train`
      run: over the steps after the first --warmup, the median step_time_s
      (tokens/s from it), the medians of comm_busy_s and comm_exposed_s, and
      the median fraction hidden, 1 - exposed/busy clipped to [0, 1] per step;
      peak_rss_mb is the largest value logged (max over ranks).
  render_sharding.py fail --world 4 --impl shardtrain --mode hybrid_shard --exit-code 1 --log L --json R
      appends a "failed" line with the exit code and the last lines of L.
  render_sharding.py note --world 2 --impl pytorch --mode ddp --text T --log L --json R
      appends a note on a measured row (shown under the table with L's last lines).
  render_sharding.py render --results R --out BENCHMARKS.md --date ... --command ...
      replaces the text between <!-- sharding:begin --> and <!-- sharding:end -->
      in --out; when the markers are missing, appends a "## Sharding (issue 5)"
      heading, the section and a placeholder for the hand-written reading.
      Text outside the markers is kept.
"""
import argparse
import os
import statistics
import sys

import benchlib

BEGIN, END = "<!-- sharding:begin -->", "<!-- sharding:end -->"
HEADING = "## Sharding (issue 5)"
READING_PLACEHOLDER = "Reading: (to be written from these figures)"
TAIL_LINES = 12

# Row order within a world size, and how each row is named in the table.
ORDER = [
    ("shardtrain", "ddp", "ddp"),
    ("shardtrain", "zero1", "zero1"),
    ("shardtrain", "no_shard", "fsdp no_shard"),
    ("shardtrain", "shard_grad_op", "fsdp shard_grad_op"),
    ("shardtrain", "full_shard", "fsdp full_shard"),
    ("shardtrain", "hybrid_shard", "fsdp hybrid_shard, 2 nodes × {half}"),
    ("pytorch", "ddp", "DistributedDataParallel + AdamW"),
    ("pytorch", "zero1", "DistributedDataParallel + ZeroRedundancyOptimizer(AdamW)"),
]




def hidden_fraction(step):
    busy, exposed = step["comm_busy_s"], step["comm_exposed_s"]
    if busy <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - exposed / busy))


def summarize(a):
    steps = [s for s in benchlib.load_jsonl(a.metrics, "render_sharding.py") if "step_time_s" in s]
    if len(steps) <= a.warmup:
        sys.exit(f"render_sharding.py: {a.metrics} has {len(steps)} steps, need more than --warmup {a.warmup}")
    measured = steps[a.warmup:]
    for key in ("comm_busy_s", "comm_exposed_s", "peak_rss_mb"):
        if any(key not in s for s in measured):
            sys.exit(f"render_sharding.py: {a.metrics}: a step line lacks {key}")
    step_time = statistics.median(s["step_time_s"] for s in measured)
    fractions = [f for f in map(hidden_fraction, measured) if f is not None]
    last = steps[-1]
    world = int(last["world_size"])
    if world != a.world:
        sys.exit(f"render_sharding.py: {a.metrics} reports world size {world}, expected {a.world}")
    benchlib.append_jsonl(a.json, {
        "impl": "shardtrain", "mode": a.mode, "strategy": last.get("strategy"), "world_size": world,
        "threads_per_rank": a.threads, "block_size": a.block_size,
        "num_parameters": last.get("num_parameters"),
        "global_batch": a.global_batch, "micro": a.micro, "accumulate": a.global_batch // (a.micro * world),
        "steps": len(steps), "measured_steps": len(measured),
        "step_time_s": step_time, "step_time_mean_s": statistics.mean(s["step_time_s"] for s in measured),
        "tokens_per_s": a.global_batch * a.block_size / step_time,
        "peak_rss_mb": max(s["peak_rss_mb"] for s in steps),
        "comm_busy_s": statistics.median(s["comm_busy_s"] for s in measured),
        "comm_exposed_s": statistics.median(s["comm_exposed_s"] for s in measured),
        "hidden_fraction": statistics.median(fractions) if fractions else None,
        "first_loss": steps[0].get("loss"), "last_loss": last.get("loss"),
    })


def log_tail(path):
    try:
        with open(path, errors="replace") as f:
            return [l.rstrip("\n") for l in f.readlines()[-TAIL_LINES:]]
    except OSError as e:
        return [f"(no log: {e})"]


def fail(a):
    tail = log_tail(a.log)
    reason = a.reason
    if not reason:
        reason = (f"timed out after {a.timeout} s" if a.exit_code in (124, 137)
                  else f"exit code {a.exit_code}")
    benchlib.append_jsonl(a.json, {"impl": a.impl, "mode": a.mode, "world_size": a.world, "failed": True,
                    "exit_code": a.exit_code, "reason": reason, "log": a.log, "log_tail": tail})


def note(a):
    benchlib.append_jsonl(a.json, {"impl": a.impl, "mode": a.mode, "world_size": a.world, "note": a.text,
                    "log": a.log, "log_tail": log_tail(a.log)})



def ratio(x, base):
    return f"{x / base:.2f}×" if base else "—"


def mode_of(r):
    return r.get("mode") or r["strategy"]  # torch_gpt_ddp.py's lines name it "strategy"


def render(rows, a):
    notes = {(r["world_size"], r["impl"], r["mode"]): r for r in rows if "note" in r}
    rows = [r for r in rows if "note" not in r]
    by_key = {(r["world_size"], r["impl"], mode_of(r)): r for r in rows}
    worlds = sorted({r["world_size"] for r in rows})
    ok = [r for r in rows if not r.get("failed")]
    if not ok:
        sys.exit("render_sharding.py: no successful runs to render")
    first = next((r for r in ok if r["impl"] == "shardtrain"), ok[0])
    params = {r.get("num_parameters") for r in ok if r.get("num_parameters")}
    mismatched = len(params) > 1
    steps, measured = first["steps"], first["measured_steps"]

    out = [BEGIN, ""]
    out.append(f"- Run: {a.date}; `nproc` = {a.nproc} ({a.cpu}); PyTorch {a.torch} (Debian) as the peer.")
    out.append(f"- Command: `{a.command}`" + (f" ({a.context})" if a.context else ""))
    accum = ", ".join(f"{first['global_batch'] // (first['micro'] * w)} per rank at world {w}" for w in worlds)
    out.append(
        f"- Model: bench/train.sh's `gpt-25m` (n_layer 8, n_head 8, n_embd 512, block size "
        f"{first['block_size']}; {' / '.join(benchlib.human_params(p) for p in sorted(params))} parameters"
        + (", **the two programs' counts differ**" if mismatched else "") +
        f"), fp32, byte data from data/corpus.txt; global batch {first['global_batch']} sequences "
        f"(micro {first['micro']}; accumulate {accum}); {steps} steps, the last {measured} measured.")
    out.append(
        f"- Machine: {a.nproc} cores, shared with other work; {a.threads} thread per rank at every "
        f"world size, so world 4 runs 4 ranks on {a.nproc} cores; OMP_WAIT_POLICY={a.omp_wait_policy} "
        "for both programs (see bench/train.sh); Gloo over loopback TCP.")
    out.append(
        "- Method: each row is one `shardtrain train` run (`--set distributed.strategy=…`, fsdp with "
        "`distributed.sharding=…`, other fsdp keys at their defaults) or one run of "
        "bench/torch_gpt_ddp.py (`--zero1` for ZeroRedundancyOptimizer) under `shardtrain launch`; "
        "hybrid_shard runs as two `shardtrain launch --nnodes 2` nodes of 2 ranks on this machine. "
        "A step is timed from the first micro-batch to zero_grad on every rank and the slowest rank "
        "counts; tokens/s = global batch × block size / median step time. Peak RSS per rank = the "
        "largest ru_maxrss of any rank (PyTorch's includes the interpreter and the torch module). "
        "Comm busy = seconds per step the communication threads spent on the gradient / parameter "
        "collectives; exposed = seconds the training thread waited for them; hidden = 1 − exposed / "
        "busy, clipped to [0, 1]; all three are medians over the measured steps (so hidden is not "
        "exactly 1 − the ratio of the two medians). PyTorch does not report these: n/a.")
    out.append("")
    out.append("| world | program | mode | tokens/s | vs PyTorch DDP | step s | peak RSS/rank MB "
               "| vs shardtrain ddp | comm busy s/step | exposed s/step | hidden |")
    out.append("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    failures, noted = [], []
    for w in worlds:
        base_tps = by_key.get((w, "pytorch", "ddp"), {})
        base_tps = None if base_tps.get("failed") else base_tps.get("tokens_per_s")
        base_rss = by_key.get((w, "shardtrain", "ddp"), {})
        base_rss = None if base_rss.get("failed") else base_rss.get("peak_rss_mb")
        for impl, mode, name in ORDER:
            r = by_key.get((w, impl, mode))
            if r is None:
                continue
            name = name.format(half=w // 2)
            prog = "shardtrain" if impl == "shardtrain" else "PyTorch"
            if r.get("failed"):
                failures.append((w, prog, name, r))
                out.append(f"| {w} | {prog} | {name} | failed | | | | | | | |")
                continue
            cols = [f"{r['tokens_per_s']:,.0f}", ratio(r["tokens_per_s"], base_tps),
                    f"{r['step_time_s']:.2f}", f"{r['peak_rss_mb']:,.0f}", ratio(r["peak_rss_mb"], base_rss)]
            if impl == "shardtrain":
                h = r.get("hidden_fraction")
                cols += [f"{r['comm_busy_s']:.2f}", f"{r['comm_exposed_s']:.2f}",
                         "n/a" if h is None else f"{h:.0%}"]
            else:
                cols += ["n/a", "n/a", "n/a"]
            n = notes.get((w, impl, mode))
            if n:
                noted.append((w, prog, name, n))
                name += f" ({len(noted)})"
            out.append(f"| {w} | {prog} | {name} | " + " | ".join(cols) + " |")
    out.append("")
    def with_tail(head, r):
        out.append(f"{head}; last lines of `{os.path.basename(r['log'])}`:")
        out.append("")
        out.append("   ```")
        out.extend("   " + l for l in r["log_tail"])
        out.append("   ```")

    if noted:
        out.append("Notes (full logs under the benchmark's output directory):")
        out.append("")
        for i, (w, prog, name, r) in enumerate(noted, 1):
            with_tail(f"{i}. world {w}, {prog} {name}: {r['note']}", r)
        out.append("")
    if failures:
        out.append("Failed runs (full logs under the benchmark's output directory):")
        out.append("")
        for w, prog, name, r in failures:
            with_tail(f"- world {w}, {prog} {name}: {r['reason']}", r)
        out.append("")
    out.append(END)
    return "\n".join(out), mismatched


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--metrics", required=True)
    s.add_argument("--world", type=int, required=True)
    s.add_argument("--mode", required=True)
    s.add_argument("--warmup", type=int, required=True)
    s.add_argument("--threads", type=int, required=True)
    s.add_argument("--global-batch", type=int, required=True)
    s.add_argument("--micro", type=int, required=True)
    s.add_argument("--block-size", type=int, required=True)
    s.add_argument("--json", required=True)
    f = sub.add_parser("fail")
    f.add_argument("--world", type=int, required=True)
    f.add_argument("--impl", choices=("shardtrain", "pytorch"), required=True)
    f.add_argument("--mode", required=True)
    f.add_argument("--exit-code", type=int, required=True)
    f.add_argument("--timeout", type=int, default=0, help="the run's time limit, for the message")
    f.add_argument("--reason", default="", help="instead of the exit code's meaning")
    f.add_argument("--log", required=True)
    f.add_argument("--json", required=True)
    n = sub.add_parser("note")
    n.add_argument("--world", type=int, required=True)
    n.add_argument("--impl", choices=("shardtrain", "pytorch"), required=True)
    n.add_argument("--mode", required=True)
    n.add_argument("--text", required=True)
    n.add_argument("--log", required=True)
    n.add_argument("--json", required=True)
    r = sub.add_parser("render")
    r.add_argument("--results", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--date", required=True)
    r.add_argument("--nproc", type=int, required=True)
    r.add_argument("--cpu", default="unknown CPU")
    r.add_argument("--torch", default="?")
    r.add_argument("--command", required=True)
    r.add_argument("--omp-wait-policy", default="unset (libgomp default)")
    r.add_argument("--threads", type=int, required=True)
    r.add_argument("--context", default="", help="free text shown after the command (timing, load)")
    a = ap.parse_args()

    if a.cmd == "summarize":
        summarize(a)
        return
    if a.cmd in ("fail", "note"):
        (fail if a.cmd == "fail" else note)(a)
        return

    section, mismatched = render(benchlib.load_jsonl(a.results, "render_sharding.py"), a)
    benchlib.write_section(a.out, BEGIN, END, section, "render_sharding.py",
                           before=f"{HEADING}\n\n", after=f"\n{READING_PLACEHOLDER}\n")
    print(section)
    print(f"wrote {a.out}")
    if mismatched:
        print("render_sharding.py: the runs report different parameter counts; the models differ",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
