#!/usr/bin/python3
"""Time to the first step: `shardtrain train` against its PyTorch peer
(bench/torch_gpt_ddp.py), both started by `shardtrain launch` on 2 ranks with
one BLAS thread each, the gpt-25m shape of bench/train.sh. A run is timed from
the launch to rank 0's line saying the first optimizer step is done, so it
counts process start, library load, rendezvous, model build, data and the
first step itself; the step's own time (each program's timing of it) is
subtracted to give the start-up. Beside them: process start and library load
alone (`shardtrain` printing its usage; `python3 -c "import torch,
torch.distributed"`). Each figure is the median of ROUNDS rounds (default 5),
a round being one run of each side, after one unmeasured run of each (the
page cache). Writes BENCHMARKS.md between <!-- first-step:begin/end -->.
  make bench-first-step      (runs: python3 bench/first_step.py)
Environment: BUILD_DIR (default build), ROUNDS."""
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
BUILD = os.environ.get("BUILD_DIR", "build")
CLI = os.path.join(BUILD, "shardtrain")
ROUNDS = int(os.environ.get("ROUNDS", "5"))
OUT = os.path.join(BUILD, "bench-first-step")
SHAPE = dict(n_layer=8, n_head=8, n_embd=512, block_size=256, global_batch=8, micro=2)

ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
ENV.pop("OPENBLAS_CORETYPE", None)  # shardtrain picks this CPU's kernels (bench/train.sh does the same)
# The peer gets the kernel set shardtrain's run reported, as in bench/train.sh:
# where OpenBLAS picks kernels below the CPU by itself, shardtrain runs itself
# again with the right ones named, and Python would not (set in main()).
PEER_ENV = dict(ENV)


def ours(run_dir):
    s = SHAPE
    sets = [f"run.dir={run_dir}", f"model.n_layer={s['n_layer']}", f"model.n_head={s['n_head']}",
            f"model.n_embd={s['n_embd']}", f"model.block_size={s['block_size']}",
            f"batch.global={s['global_batch']}", f"batch.micro={s['micro']}", "batch.accumulate=null",
            "trainer.max_steps=1", "trainer.eval_every=0", "trainer.sample_tokens=0",
            "trainer.progress=plain", "distributed.strategy=ddp", "distributed.threads_per_rank=1"]
    cmd = [CLI, "train", "configs/default.yaml", "--nproc-per-node", "2"]
    for kv in sets:
        cmd += ["--set", kv]
    return cmd, re.compile(r"\] step 1/1 ")


def peer():
    s = SHAPE
    cmd = [CLI, "launch", "--nproc-per-node", "2", "--", "/usr/bin/python3", "bench/torch_gpt_ddp.py",
           "--n-layer", str(s["n_layer"]), "--n-head", str(s["n_head"]), "--n-embd", str(s["n_embd"]),
           "--block-size", str(s["block_size"]), "--global-batch", str(s["global_batch"]),
           "--micro", str(s["micro"]), "--threads", "1", "--steps", "1", "--warmup", "0",
           "--first-step-line"]
    return cmd, re.compile(r"first step done in ([0-9.]+) s")


def timed(cmd, pattern, env):
    """Seconds from start to the first line matching `pattern`, and the match."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen, match, lines = None, None, []
    for line in p.stdout:
        lines.append(line)
        if seen is None:
            m = pattern.search(line)
            if m:
                seen, match = time.monotonic() - t0, m
    if p.wait() != 0 or seen is None:
        sys.exit("bench/first_step.py: run failed:\n  " + " ".join(cmd) + "\n" + "".join(lines[-30:]))
    return seen, match


def bare(cmd, env):
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - t0


def one_round(k):
    run_dir = os.path.join(OUT, f"run{k}")
    subprocess.run(["rm", "-rf", run_dir], check=True)
    total_o, _ = timed(*ours(run_dir), ENV)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        first = json.loads(f.readline())
    step_o = first["step_time_s"]
    if first.get("blas_core"):
        PEER_ENV["OPENBLAS_CORETYPE"] = first["blas_core"].upper()
    total_p, m = timed(*peer(), PEER_ENV)
    step_p = float(m.group(1))
    return {"ours": total_o, "ours_step": step_o, "peer": total_p, "peer_step": step_p,
            "ours_load": bare([CLI], ENV),
            "peer_load": bare(["/usr/bin/python3", "-c", "import torch, torch.distributed"], PEER_ENV),
            "blas_core": first.get("blas_core", "")}


def main():
    if not os.access(CLI, os.X_OK):
        sys.exit(f"bench/first_step.py: {CLI} is missing; run 'make build'")
    os.makedirs(OUT, exist_ok=True)
    load_before = open("/proc/loadavg").read().split()[:3]
    one_round("-warm")
    rounds = [one_round(k) for k in range(ROUNDS)]
    load_after = open("/proc/loadavg").read().split()[:3]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "blas_core"}
    core = rounds[-1]["blas_core"] or "not OpenBLAS"
    start_o = statistics.median(r["ours"] - r["ours_step"] for r in rounds)
    start_p = statistics.median(r["peer"] - r["peer_step"] for r in rounds)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    flags = sorted({f for l in open("/proc/cpuinfo") if l.startswith("flags")
                    for f in l.split(":", 1)[1].split() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")})
    s = SHAPE
    lines = [
        "<!-- first-step:begin -->", "",
        "## Time to the first step", "",
        f"- Command: `make bench-first-step   # runs: python3 bench/first_step.py` "
        f"(load average {' '.join(load_before)} before, {' '.join(load_after)} after)",
        f"- Machine: {cpu}, {os.cpu_count()} cores; flags: {' '.join(flags) or 'none of avx2/avx512'}; "
        f"OpenBLAS kernels {core} on both sides (shardtrain's choice, OPENBLAS_CORETYPE unset; the peer "
        "given the same), one BLAS thread per rank. Ranks of `shardtrain train --nproc-per-node` are "
        "forked from the launcher's fork server; the peer's are exec'ed by the same launcher.",
        f"- Job: 2 ranks on this host through `shardtrain launch`, fp32 DDP, the gpt-25m shape "
        f"({s['n_layer']} layers, n_embd {s['n_embd']}, block {s['block_size']}, global batch "
        f"{s['global_batch']}, micro {s['micro']}); `shardtrain train configs/default.yaml` against "
        "bench/torch_gpt_ddp.py (PyTorch DDP over Gloo). Timed from the launch to rank 0's line that the "
        "first optimizer step is done; start-up = that less the step's own time. Median of "
        f"{ROUNDS} rounds after one unmeasured round (page cache warm).", "",
        "| | shardtrain s | PyTorch s | PyTorch / shardtrain |",
        "|---|---:|---:|---:|",
        f"| launch to first step done | {med['ours']:.2f} | {med['peer']:.2f} | {med['peer'] / med['ours']:.2f}× |",
        f"| of which the first step | {med['ours_step']:.2f} | {med['peer_step']:.2f} | |",
        f"| start-up (process start, library load, rendezvous, model build, data) | {start_o:.2f} | "
        f"{start_p:.2f} | {start_p / start_o:.2f}× |",
        f"| process start and library load alone (one process) | {med['ours_load']:.2f} | "
        f"{med['peer_load']:.2f} | {med['peer_load'] / med['ours_load']:.2f}× |",
        "", "<!-- first-step:end -->"]
    section = "\n".join(lines)
    benchlib.write_section("BENCHMARKS.md", "<!-- first-step:begin -->", "<!-- first-step:end -->",
                           section, "first_step.py")
    print(section)
    with open(os.path.join(OUT, "rounds.json"), "w") as f:
        json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
