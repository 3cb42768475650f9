#!/usr/bin/python3
"""Tensor parallelism on one host: `make bench-tp`.

GPT-2 124M and llama-25m (bench/train.sh's shapes), each trained by
`shardtrain train` at 2 ranks as DDP x2, FULL_SHARD x2, TP x2 with sequence
parallelism and TP x2 without it, on the same data, global batch and steps,
one BLAS thread per rank, fp32, in one run. Reported per run: tokens/s
(median over the steps after the warm-up), peak RSS per rank (the larger
rank's, as metrics.jsonl gives it), the seconds per step the tensor-parallel
collectives took (tp_comm_s: the tp group's communication thread busy), and
the ratios to DDP in the same run. Goals (issue "mesh + TP"): TP's peak RSS
<= 0.6x DDP's, which FULL_SHARD cannot reach at 2 ranks because it does not
split activations; tokens/s >= 0.8x DDP's.

Writes the table into BENCHMARKS.md between <!-- tp:begin --> and
<!-- tp:end -->. Environment: BUILD_DIR (default build), MODELS (default
"gpt2-124m llama-25m"), MODES (default "ddp full_shard tp2 tp2-no-sp"),
RUN_TIMEOUT (seconds per run, default 900). About 15 minutes on 2 cores.
"""
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import write_section  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BUILD = os.environ.get("BUILD_DIR", "build")
OUT = os.path.join(BUILD, "bench-tp")

# n_layer n_head n_embd block global micro steps warmup, and extra keys: as bench/train.sh.
MODELS = {
    "gpt2-124m": ((12, 12, 768, 1024, 2, 1, 6, 2), ["model.type=gpt", "model.vocab_size=50257"]),
    "llama-25m": ((8, 8, 512, 256, 8, 2, 10, 3),
                  ["model.type=llama", "model.vocab_size=256", "model.n_kv_head=2", "model.intermediate_size=1408"]),
}
MODES = {
    "ddp": ["distributed.strategy=ddp"],
    "full_shard": ["distributed.strategy=fsdp", "distributed.sharding=full_shard"],
    "tp2": ["distributed.strategy=ddp", "distributed.tensor_parallel=2"],
    "tp2-no-sp": ["distributed.strategy=ddp", "distributed.tensor_parallel=2", "distributed.sequence_parallel=false"],
}


def run(model, mode):
    (layers, heads, embd, block, batch, micro, steps, warmup), extra = MODELS[model]
    run_dir = os.path.abspath(os.path.join(OUT, f"{model}-{mode}"))
    sets = [f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={embd}", f"model.block_size={block}",
            f"batch.global={batch}", f"batch.micro={micro}", "batch.accumulate=null", f"trainer.max_steps={steps}",
            "trainer.eval_every=0", "trainer.sample_tokens=0", "trainer.progress=none", "trainer.log_every=1",
            "distributed.threads_per_rank=1", "precision=fp32", "checkpoint.every_n_steps=0",
            f"run.dir={run_dir}", "run.overwrite=true", "data.train=data/corpus.txt"] + extra + MODES[mode]
    cmd = [os.path.join(BUILD, "shardtrain"), "train", "configs/default.yaml", "--nproc-per-node", "2"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    start = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=int(os.environ.get("RUN_TIMEOUT", "900")))
    if p.returncode != 0:
        return {"model": model, "mode": mode, "failed": p.returncode, "log": (p.stdout + p.stderr)[-2000:]}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f if '"tokens_per_s"' in l]
    measured = rows[warmup:] or rows
    return {"model": model, "mode": mode, "wall_s": time.time() - start,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
            "step_s": statistics.median(r["step_time_s"] for r in measured),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rows),
            "tp_comm_s": statistics.median(r.get("tp_comm_s", 0.0) for r in measured),
            "comm_busy_s": statistics.median(r.get("comm_busy_s", 0.0) for r in measured),
            "blas_core": rows[-1].get("blas_core", ""), "strategy": rows[-1].get("strategy", "")}


def cpu():
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    shown = [x for x in ("avx512f", "avx512_bf16", "amx_bf16") if x in flags]
    return f"{model} ({', '.join(shown) or 'no avx512'})"


def render(results, date):
    lines = ["<!-- tp:begin -->", "",
             f"`make bench-tp` (runs `python3 bench/tp.py`), {date}, {cpu()}, {os.cpu_count()} cores; "
             "2 ranks x 1 BLAS thread, fp32, OpenBLAS "
             f"{next((r['blas_core'] for r in results if r.get('blas_core')), '?')} kernels. "
             "Ratios are to DDP x2 in the same run.", "",
             "| model | run | tokens/s | × DDP | step s | peak RSS / rank MB | × DDP | TP collectives s/step |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model in MODELS:
        base = next((r for r in results if r["model"] == model and r["mode"] == "ddp" and "failed" not in r), None)
        for r in (x for x in results if x["model"] == model):
            if "failed" in r:
                lines.append(f"| {model} | {r['mode']} | failed ({r['failed']}) | | | | | |")
                continue
            speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""
            mem = f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}" if base else ""
            tp = f"{r['tp_comm_s']:.3f}" if r["mode"].startswith("tp") else ""
            lines.append(f"| {model} | {r['mode']} | {r['tokens_per_s']:.0f} | {speed} | {r['step_s']:.2f} | "
                         f"{r['peak_rss_mb']:.0f} | {mem} | {tp} |")
    lines += ["", "<!-- tp:end -->"]
    return "\n".join(lines)


def main():
    os.makedirs(OUT, exist_ok=True)
    models = os.environ.get("MODELS", " ".join(MODELS)).split()
    modes = os.environ.get("MODES", " ".join(MODES)).split()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for model in models:
        for mode in modes:
            r = run(model, mode)
            print(json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
            if "failed" in r:
                print(r["log"], file=sys.stderr)
            results.append(r)
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    section = render(results, date)
    print(section)
    write_section(os.path.join(ROOT, "BENCHMARKS.md"), "<!-- tp:begin -->", "<!-- tp:end -->", section, "bench/tp.py",
                  before="## Tensor parallelism on one host\n\n")


if __name__ == "__main__":
    main()
