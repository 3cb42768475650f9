#!/usr/bin/env python3
"""Renders bench/lora.sh's runs (metrics.jsonl per run directory) into
BENCHMARKS.md between <!-- lora:begin --> and <!-- lora:end -->."""
import argparse
import datetime
import os
import statistics

import benchlib

BEGIN, END = "<!-- lora:begin -->", "<!-- lora:end -->"
ORDER = ["full", "lora-none", "lora-int8", "lora-nf4"]
LABEL = {"full": "full fine-tuning, fp32", "lora-none": "LoRA r=8, fp32 base",
         "lora-int8": "LoRA r=8, int8 base", "lora-nf4": "QLoRA r=8, nf4 base"}


def cpu():
    model, flags = "?", []
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name") and model == "?":
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            have = set(line.split(":", 1)[1].split())
            flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
    return model, flags


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("out")
    ap.add_argument("--command", required=True)
    ap.add_argument("--load", default="")
    a = ap.parse_args()
    rows = {}
    for name in os.listdir(a.runs):
        lines = [l for l in benchlib.load_jsonl(os.path.join(a.runs, name, "metrics.jsonl"), "render_lora.py")
                 if "loss" in l]
        measured = lines[1:] or lines  # the first step warms up
        rows[name] = {
            "params": lines[0].get("num_parameters", 0),
            "bytes": statistics.median(l.get("comm_reduced_bytes", 0) + l.get("comm_gathered_bytes", 0)
                                       for l in measured),
            "tok_s": statistics.median(l["tokens_per_s"] for l in measured),
            "rss": max(l["peak_rss_mb"] for l in lines),
            "strategy": lines[0].get("strategy", "?"),
            "world": lines[0].get("world_size", 0),
        }
    full = rows["full"]
    model, flags = cpu()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = [BEGIN, "", "## LoRA and QLoRA against full fine-tuning (CPU)", "",
            f"- Run: {now}; CPU: {model} (flags: {', '.join(flags) or 'none of avx2/avx512'}); "
            f"`nproc` = {os.cpu_count()}; load average {a.load}.",
            f"- Command: `{a.command}`",
            f"- Model: GPT n_layer 8, n_head 8, n_embd 512, block 256 ({full['params']/1e6:.1f} M parameters); "
            f"{full['world']} ranks, strategy {full['strategy']}, 1 sequence of 256 tokens per rank per step, "
            "1 intra-op thread per rank. Bytes: what one rank handed to collectives per step (reductions' "
            "inputs and all-gathers' outputs; CommStats), median over the steps after the first. Peak RSS: "
            "the largest rank's. Tokens/s: median over the steps after the first, all ranks together.", "",
            "| run | bytes/step | vs full | peak RSS MB per rank | vs full | tokens/s | vs full |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name in ORDER:
        if name not in rows:
            continue
        r = rows[name]
        text.append(f"| {LABEL[name]} | {r['bytes']:,.0f} | {r['bytes'] / max(full['bytes'], 1):.4f}× | "
                    f"{r['rss']:.0f} | {r['rss'] / full['rss']:.2f}× | {r['tok_s']:.0f} | "
                    f"{r['tok_s'] / full['tok_s']:.2f}× |")
    if "lora-none" in rows and "lora-nf4" in rows:
        cost = 1 - rows["lora-nf4"]["tok_s"] / rows["lora-none"]["tok_s"]
        text += ["", f"On-the-fly nf4 dequantization (forward and again in backward) costs "
                     f"{cost * 100:.0f}% of the fp32-base LoRA throughput in this run."]
    text += ["", END]
    block = "\n".join(text)
    benchlib.write_section(a.out, BEGIN, END, block, "render_lora.py")
    print(block)


if __name__ == "__main__":
    main()
