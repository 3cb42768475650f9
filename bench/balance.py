#!/usr/bin/env python3
"""Measured load balancing: `make bench-balance` (needs root for the cgroup).

  1. One rank throttled: 2 ranks (ddp, one thread each), rank 1 in a cgroup
     v1 cpu group at half a core (cfs_quota_us 50000 of 100000), under
     distributed.load_balance even and measured. Goal: measured >= 1.35x
     the tokens/s of even (the ideal, 1 + 0.5 = 1.5 cores' worth against 2 x
     the throttled rank's 0.5, is 1.5x).
  2. Homogeneous: no throttle. Goal: measured >= 0.98x even.
  3. Uneven hosts: two network-namespace hosts (tests/dist/netns_hosts.sh),
     host a with 2 ranks and host b with 1 rank held to half a core, the
     launchers' --nproc-per-node 2 and 1 (global batch 48).

Every setting at its default (rebalance_every 20: the first re-plan after
step 20). Tokens/s is the median over the steps after the first WARM (the
measured run's shares are planned by then), the same model and global batch in every
run: a GPT of 4 layers, width 256, block 128, global batch 32 in 2
micro-steps, fp32. Writes the table into BENCHMARKS.md between
<!-- balance:begin --> and <!-- balance:end -->. Environment: BUILD_DIR
(default build), STEPS (default 60), WARM (default 20), REPEAT (default 3: single runs on a
VM drift by 10% within an hour).
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import shutil
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.abspath(os.path.join(ROOT, os.environ.get("BUILD_DIR", "build"), "shardtrain"))
STEPS = int(os.environ.get("STEPS", "60"))
WARM = int(os.environ.get("WARM", "20"))
REPEAT = int(os.environ.get("REPEAT", "3"))
CPU = "/sys/fs/cgroup/cpu"


def sets(run_dir, mode):
    s = ["model.type=gpt", "model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.block_size=128",
         "data.train=data/corpus.txt", "data.val_fraction=0", "batch.global=32", "batch.accumulate=2",
         "batch.micro=null", f"trainer.max_steps={STEPS}", "trainer.eval_every=0", "trainer.sample_tokens=0",
         "trainer.progress=none", "checkpoint.every_n_steps=0", "distributed.strategy=ddp",
         "distributed.threads_per_rank=1", "precision=fp32", f"run.dir={run_dir}",
         f"distributed.load_balance={mode}"]
    return [a for x in s for a in ("--set", x)]


def remove_group(group):
    """The cgroup, once its exited processes have left it (up to 5 s)."""
    for _ in range(50):
        try:
            os.rmdir(group)
            return
        except OSError:
            time.sleep(0.1)


def rank_of(launcher):
    """The rank process a one-rank launcher started (its child that is not
    the fork server)."""
    for _ in range(600):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            if int(stat[stat.rindex(")") + 2:].split()[1]) == launcher and comm == "shardtrain":
                return pid
        time.sleep(0.1)
    sys.exit(f"bench/balance.py: launcher {launcher} started no rank")


def launch(cmds, run_dir, throttled, slow):
    """Starts the launchers `cmds` (one per node), holds the rank process of
    the last one to half a core when `throttled`, waits; the medians after
    WARM of tokens/s, the share and compute seconds of rank `slow` (and of
    rank 0's compute)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDTRAIN_JOB_TOKEN=os.urandom(16).hex())
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    group = None
    if throttled:
        group = os.path.join(CPU, f"shardtrain-bench-{os.getpid()}")
        os.makedirs(group, exist_ok=True)
        for name, value in (("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "50000"),
                            ("cgroup.procs", rank_of(procs[-1].pid))):
            with open(os.path.join(group, name), "w") as f:
                f.write(value)
    outs = [p.communicate()[0] for p in procs]
    if group:
        remove_group(group)
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"bench/balance.py: {run_dir} exited {p.returncode}:\n{out[-3000:]}")
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in l]
    timed = [r for r in rows if r["step"] > WARM]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "share1": statistics.median(r["shares"][slow] for r in timed),
            "compute": [statistics.median(r["compute_s_ranks"][k] for r in timed) for k in (0, slow)],
            "blas_core": rows[-1].get("blas_core", "")}


def run(mode, throttled, work):
    """Two launchers of one rank each on this host (nodes 0 and 1, loopback
    TCP between them), so that rank 1 is the second launcher's child."""
    run_dir = os.path.join(work, f"{mode}-{'throttled' if throttled else 'free'}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return launch([[CLI, "train", "configs/default.yaml", *sets(run_dir, mode), "--nnodes", "2", "--node-rank",
                    str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
                   for node in (0, 1)], run_dir, throttled, 1)


HOSTS = "lbal"  # network-namespace hosts lbal-a and lbal-b, 10.78.0.1 and .2
NETNS = os.path.join(ROOT, "tests", "dist", "netns_hosts.sh")


def hosts(up):
    cmd = f"source {NETNS}; hosts_up {HOSTS} 10.78.0." if up else \
        f"source {NETNS}; HOST_NS=({HOSTS}-a {HOSTS}-b); hosts_down"
    subprocess.run(["bash", "-c", cmd], check=up)


def run_hosts(mode, work):
    """Uneven hosts: host a runs 2 ranks, host b 1 rank held to half a core
    (world 3; global batch 48 = 8 x 2 x 3 under even)."""
    run_dir = os.path.join(work, f"hosts-{mode}")
    args = sets(run_dir, mode) + ["--set", "batch.global=48"]
    return launch([["ip", "netns", "exec", f"{HOSTS}-{'ab'[node]}", CLI, "train", "configs/default.yaml", *args,
                    "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(2 - node),
                    "--master-addr", "10.78.0.1", "--master-port", "29611"] for node in (0, 1)], run_dir, True, 2)


def main():
    if os.geteuid() != 0 or not os.access(os.path.join(CPU, "cgroup.procs"), os.W_OK):
        sys.exit("bench/balance.py: needs root and a cgroup v1 cpu controller at " + CPU)
    load_before = open("/proc/loadavg").read().split()[:3]
    work = tempfile.mkdtemp(prefix="bench_balance_")
    results = {}
    try:
        # Each repeat alternates which mode runs first, so that a drift of
        # the machine's speed over minutes falls on both alike.
        for i in range(REPEAT):
            for throttled in (True, False):
                for mode in ("even", "measured")[::1 if i % 2 == 0 else -1]:
                    r = run(mode, throttled, work)
                    results.setdefault((throttled, mode), []).append(r)
                    print(f"{'throttled' if throttled else 'homogeneous'} {mode}: {r['tokens_per_s']:.0f} tokens/s, "
                          f"rank 1 share {r['share1']:.3f}, compute s/step {r['compute'][0]:.3f} {r['compute'][1]:.3f}",
                          flush=True)
        hosts(False)
        hosts(True)
        try:
            for i in range(REPEAT):
                for mode in ("even", "measured")[::1 if i % 2 == 0 else -1]:
                    r = run_hosts(mode, work)
                    results.setdefault(("hosts", mode), []).append(r)
                    print(f"uneven hosts {mode}: {r['tokens_per_s']:.0f} tokens/s, rank 2 share {r['share1']:.3f}",
                          flush=True)
        finally:
            hosts(False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = open("/proc/loadavg").read().split()[:3]
    cpu = re.search(r"model name\s*:\s*(.*)", open("/proc/cpuinfo").read()).group(1)
    flags = open("/proc/cpuinfo").read()
    isa = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "no avx512_bf16/AMX"
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in results.items()}
    share = {k: statistics.median(x["share1"] for x in v) for k, v in results.items()}
    blas = results[(False, "even")][0]["blas_core"]
    lines = [
        "<!-- balance:begin -->",
        f"`make bench-balance` (bench/balance.py), {cpu} ({isa}; OpenBLAS {blas or 'kernels n/a'}), 2 ranks "
        f"(two launchers of one rank on this host), ddp, "
        f"one thread each, GPT 4 x 256, block 128, global batch 32 in 2 micro-steps, fp32, {STEPS} steps, median "
        f"tokens/s after step {WARM}, {REPEAT} run(s) each (alternating which mode runs first), load_balance defaults; load average {' '.join(load_before)} before, "
        f"{' '.join(load_after)} after.",
        "",
        "| case | even tokens/s | measured tokens/s | measured / even | goal | rank 1's share (measured) |",
        "|---|---|---|---|---|---|",
    ]
    for case, goal, name in ((True, 1.35, "rank 1 throttled to half a core"), (False, 0.98, "homogeneous"),
                             ("hosts", None, "uneven hosts: 2 ranks on host a, 1 on host b at half a core "
                                             "(global batch 48; share: host b's rank)")):
        e, m = med[(case, "even")], med[(case, "measured")]
        verdict = f">= {goal}x ({'met' if m / e >= goal else 'not met'})" if goal else "-"
        lines.append(f"| {name} | {e:.0f} | {m:.0f} | **{m / e:.2f}x** | {verdict} | {share[(case, 'measured')]:.3f} |")
    lines.append("<!-- balance:end -->")
    table = "\n".join(lines)
    print(table)
    path = os.path.join(ROOT, "BENCHMARKS.md")
    text = open(path).read()
    if "<!-- balance:begin -->" in text:
        text = re.sub(r"<!-- balance:begin -->.*?<!-- balance:end -->", lambda _: table, text, flags=re.S)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
