#!/usr/bin/env python3
"""Renders bench/precision.sh's runs (metrics.jsonl per run directory) into
BENCHMARKS.md between <!-- precision:begin --> and <!-- precision:end -->."""
import argparse
import datetime
import json
import os
import statistics

import benchlib

BEGIN, END = "<!-- precision:begin -->", "<!-- precision:end -->"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("out")
    ap.add_argument("--command", required=True)
    ap.add_argument("--load", default="")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    rows = []
    for name in sorted(os.listdir(a.runs)):
        path = os.path.join(a.runs, name, "metrics.jsonl")
        lines = [json.loads(l) for l in open(path) if '"loss"' in l]
        measured = lines[1:] or lines  # the first step warms up
        precision, ckpt = name.split("-ckpt-")
        rows.append({
            "precision": precision,
            "ckpt": ckpt == "true",
            "params": lines[0].get("num_parameters", 0),
            "tok_s": statistics.median(l["tokens_per_s"] for l in measured),
            "rss": max(l["peak_rss_mb"] for l in lines),
        })
    order = {"fp32": 0, "bf16-mixed": 1, "bf16-true": 2}
    rows.sort(key=lambda r: (order.get(r["precision"], 9), r["ckpt"]))
    base = next((r for r in rows if r["precision"] == "fp32" and not r["ckpt"]), rows[0])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = [BEGIN, "", "## Precision modes and activation checkpointing (CPU, one process)", "",
            f"- Run: {now}; `nproc` = {os.cpu_count()}; load average {a.load}.",
            f"- Command: `{a.command}`",
            f"- Model: GPT n_layer 8, n_head 8, n_embd 512, block 256 ({rows[0]['params']/1e6:.1f} M parameters); "
            f"batch {a.batch} sequence(s) of 256 tokens per step; median tokens/s over the steps after the first; "
            "peak RSS of the process.", "",
            "| precision | activation checkpointing | tokens/s | vs fp32 without checkpointing | peak RSS MB |",
            "|---|---|---:|---:|---:|"]
    for r in rows:
        ratio = r["tok_s"] / base["tok_s"]
        text.append(f"| {r['precision']} | {'yes' if r['ckpt'] else 'no'} | {r['tok_s']:.0f} | "
                    f"{ratio:.2f}× | {r['rss']:.0f} |")
    text += ["", END]
    block = "\n".join(text)
    benchlib.write_section(a.out, BEGIN, END, block, "render_precision.py")
    print(block)


if __name__ == "__main__":
    main()
