#!/usr/bin/env python3
"""Measured load balancing (distributed.load_balance) through the real CLI
and launcher, on a small GPT and chat records with the prompts masked and
several conversations packed to a row.

  exact CLI SRC      measured runs that split every micro-step unevenly
                     (shares 3:1, or 3:1:1:2 over 4 ranks) give the losses
                     of the `even` run within 1e-6 relative over 20 steps
                     under ddp, zero1, fsdp full_shard and hybrid_shard (two
                     launchers, one node each), and after a resume from the
                     step-10 checkpoint.
  edges CLI SRC      a global batch smaller than the ranks (a rank computes
                     an empty micro-step and still joins every collective),
                     one not divisible by the shares, and world 1: losses of
                     the one-process run.
  nodes CLI SRC      two launchers of 2 and 1 ranks: shares start from the
                     ranks' threads (1:1:2 on two cores); even run's losses.
  throttled CLI SRC  rank 1 in a cgroup at half a core: its share falls to
                     about 1/3 of the batch, the log names it as a straggler;
                     the throttle lifted, its share comes back and the log
                     notes the recovery; losses still the even run's.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import shutil

STEPS = 20
RTOL = 1e-6


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def base_sets(run_dir, steps=STEPS):
    return ["model.type=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=256",
            "data.train=data/chat.jsonl", "data.format=jsonl", "data.chat_template=chatml",
            "data.packing=true", "data.val_fraction=0", "batch.global=8", "batch.micro=2",
            "batch.accumulate=null", f"trainer.max_steps={steps}", "trainer.eval_every=0",
            "trainer.sample_tokens=0", "trainer.progress=none", "distributed.threads_per_rank=1",
            "schedule.warmup_steps=2", "precision=fp32", f"run.dir={run_dir}"]


def measured(shares, every=3):
    return ["distributed.load_balance=measured", f"distributed.shares=[{','.join(map(str, shares))}]",
            f"distributed.rebalance_every={every}"]


def train(cli, src, sets, nproc, nodes=1, env_extra=None, on_start=None, counts=None):
    """Runs `shardtrain train`; returns its output. `nodes` launchers of
    nproc/nodes ranks each on this host (hybrid_shard's nodes), or one per
    entry of `counts` with that many ranks."""
    counts = counts or [nproc // nodes] * nodes
    nodes = len(counts)
    args = [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDTRAIN_TIMEOUT_S="120", **(env_extra or {}))
    cmds = []
    if nodes == 1:
        cmds.append([cli, "train", "configs/default.yaml", *args, "--nproc-per-node", str(nproc)])
    else:
        env["SHARDTRAIN_JOB_TOKEN"] = os.urandom(16).hex()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        for node in range(nodes):
            cmds.append([cli, "train", "configs/default.yaml", *args, "--nnodes", str(nodes), "--node-rank",
                         str(node), "--nproc-per-node", str(counts[node]), "--master-addr", "127.0.0.1",
                         "--master-port", str(port)])
    procs = [subprocess.Popen(c, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    if on_start:
        on_start(procs)
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        outs.append(out)
        if p.returncode != 0:
            print(out[-4000:])
            fail(f"shardtrain train {' '.join(sets[-6:])} exited {p.returncode}")
    return "\n".join(outs)


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line and '"eval_loss"' not in line]


def losses(run_dir):
    return [r["loss"] for r in rows(run_dir)]


def same_losses(what, ours, theirs, steps=STEPS):
    if len(ours) != steps or len(theirs) != steps:
        fail(f"{what}: {len(ours)} and {len(theirs)} step losses, expected {steps}")
    for i, (o, t) in enumerate(zip(ours, theirs)):
        if abs(o - t) > RTOL * abs(t):
            fail(f"{what}: step {i + 1} loss {o:.9f}, the even run's {t:.9f} (relative {abs(o - t) / abs(t):.2e})")
    return max(abs(o - t) / abs(t) for o, t in zip(ours, theirs))


def uneven_steps(run_dir):
    return sum(1 for r in rows(run_dir) if len(set(r["samples_ranks"])) > 1)


def cmd_exact(cli, src):
    work = tempfile.mkdtemp(prefix="load_balance_")
    try:
        for strategy, nproc, nodes in (("ddp", 2, 1), ("zero1", 2, 1), ("fsdp/full_shard", 2, 1),
                                       ("fsdp/hybrid_shard", 4, 2)):
            name, _, sharding = strategy.partition("/")
            pick = [f"distributed.strategy={name}"] + ([f"distributed.sharding={sharding}"] if sharding else [])
            even_dir, bal_dir = (os.path.join(work, strategy.replace("/", "-") + k) for k in ("-even", "-measured"))
            train(cli, src, base_sets(even_dir) + pick, nproc, nodes)
            shares = [3, 1] if nproc == 2 else [3, 1, 1, 2]
            # Never re-planned here: every step splits unevenly.
            train(cli, src, base_sets(bal_dir) + pick + measured(shares, every=100), nproc, nodes)
            if uneven_steps(bal_dir) != STEPS:
                fail(f"{strategy}: the measured run split {uneven_steps(bal_dir)} of {STEPS} steps unevenly")
            worst = same_losses(f"{strategy} measured vs even", losses(bal_dir), losses(even_dir))
            print(f"{strategy}: {STEPS} losses of the measured run (shares {shares}, every step uneven) equal "
                  f"the even run's within {RTOL} (largest difference {worst:.1e} relative)")
            if strategy == "ddp":
                # A measured run's step-10 checkpoint (its shares re-planned
                # every 3 steps), resumed in another run directory: steps
                # 11..20 are the even run's.
                saved_dir, resumed = os.path.join(work, "saving"), os.path.join(work, "resumed")
                sets = pick + measured(shares)
                train(cli, src, base_sets(saved_dir) + sets + ["checkpoint.every_n_steps=10", "checkpoint.keep=0"],
                      nproc)
                checkpoint = os.path.join(saved_dir, "checkpoints", "step-000010")
                with open(os.path.join(checkpoint, "train_state.bin")) as f:
                    saved = json.load(f)["load_balance"]["shares"]
                train(cli, src, base_sets(resumed) + sets + [f"checkpoint.resume={checkpoint}"], nproc)
                after = rows(resumed)
                if [r["step"] for r in after] != list(range(11, STEPS + 1)):
                    fail(f"the resumed run logged steps {[r['step'] for r in after]}, expected 11..{STEPS}")
                same_losses("ddp measured, resumed at step 10", [r["loss"] for r in after], losses(even_dir)[10:],
                            steps=STEPS - 10)
                if any(abs(a - b) > 1e-8 for a, b in zip(after[0]["shares"], saved)):
                    fail(f"resumed step 11 ran with shares {after[0]['shares']}, the checkpoint holds {saved}")
                print(f"ddp: resumed at step 10 with the checkpoint's shares {saved}; steps 11..{STEPS} equal the "
                      f"even run's")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cmd_edges(cli, src):
    work = tempfile.mkdtemp(prefix="load_balance_")
    try:
        cases = [
            # global 2 over 2 micro-steps of 1 row: rank 1 computes empty micro-steps.
            ("global batch smaller than the ranks", ["batch.global=2", "batch.micro=null", "batch.accumulate=2"],
             [1, 1], 2),
            # 5 rows per step at shares 2:1 (3.33, 1.67).
            ("global batch not divisible by the shares", ["batch.global=5", "batch.micro=null",
                                                          "batch.accumulate=1"], [2, 1], 2),
            ("world 1", ["batch.global=5", "batch.micro=null", "batch.accumulate=1"], [1], 1),
        ]
        for what, batch, shares, nproc in cases:
            one = os.path.join(work, what.replace(" ", "-") + "-one")
            bal = os.path.join(work, what.replace(" ", "-") + "-measured")
            single_batch = [b if not b.startswith("batch.accumulate") else "batch.accumulate=null" for b in batch]
            single_batch = [b if not b.startswith("batch.micro") else "batch.micro=1" for b in single_batch]
            train(cli, src, base_sets(one, steps=8) + ["distributed.strategy=single"] + single_batch, 1)
            train(cli, src, base_sets(bal, steps=8) + ["distributed.strategy=ddp"] + batch + measured(shares, 2), nproc)
            if nproc > 1 and uneven_steps(bal) == 0:
                fail(f"{what}: no step split unevenly")
            if what.startswith("global batch smaller") and not any(0 in r["samples_ranks"] for r in rows(bal)):
                fail(f"{what}: no rank computed an empty step")
            same_losses(what, losses(bal), losses(one), steps=8)
            print(f"{what}: 8 losses equal the one-process run's within {RTOL}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cmd_nodes(cli, src):
    """Hosts of different sizes: node 0 runs 2 ranks, node 1 one, threads per
    rank automatic (cores / local ranks: on this 2-core machine 1 and 2), so
    the ranks start at shares 1:1:2; the losses are the even 3-rank run's."""
    work = tempfile.mkdtemp(prefix="load_balance_")
    try:
        batch = ["batch.global=12", "batch.micro=2", "batch.accumulate=null", "distributed.strategy=ddp"]
        even_dir, bal_dir = os.path.join(work, "even"), os.path.join(work, "nodes")
        train(cli, src, base_sets(even_dir) + batch, 3)
        cores = os.cpu_count()
        threads = [max(1, cores // 2)] * 2 + [cores]
        train(cli, src, base_sets(bal_dir) + batch + ["distributed.load_balance=measured",
                                                      "distributed.threads_per_rank=0",
                                                      "distributed.rebalance_every=100"], 3, counts=[2, 1])
        first = rows(bal_dir)[0]
        want = [t / sum(threads) for t in threads]
        if first["world_size"] != 3 or any(abs(a - b) > 1e-8 for a, b in zip(first["shares"], want)):
            fail(f"nodes of 2 and 1 ranks started at shares {first['shares']}, expected {want} (threads {threads})")
        worst = same_losses("nodes of 2 and 1 ranks, measured", losses(bal_dir), losses(even_dir))
        print(f"nodes of 2 and 1 ranks: started at shares {first['shares']} from their threads; {STEPS} losses "
              f"equal the even 3-rank run's (largest difference {worst:.1e} relative)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def rank_of(launcher, timeout=60):
    """The pid of the rank process a one-rank launcher started (its child
    that is not the fork server)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == launcher and comm == "shardtrain":
                return int(pid)
        time.sleep(0.2)
    fail(f"launcher {launcher} started no rank process")


CPU_CGROUP = "/sys/fs/cgroup/cpu"


def release(group):
    """Moves every process of cgroup `group` back to the root cpu group."""
    try:
        with open(os.path.join(group, "cgroup.procs")) as f:
            left = f.read().split()
        for pid in left:
            with open(os.path.join(CPU_CGROUP, "cgroup.procs"), "w") as f:
                f.write(pid)
    except OSError:
        pass


def cmd_throttled(cli, src):
    cpu = CPU_CGROUP
    if not os.access(os.path.join(cpu, "cgroup.procs"), os.W_OK):
        fail(f"{cpu} is not a writable cgroup v1 cpu controller (this test runs as root)")
    group = os.path.join(cpu, f"shardtrain-throttle-{os.getpid()}")
    os.mkdir(group)
    work = tempfile.mkdtemp(prefix="load_balance_")
    steps, lift_at = 60, 30
    try:
        sets = ["batch.global=32", "batch.micro=4"]
        even_dir, bal_dir = os.path.join(work, "even"), os.path.join(work, "measured")
        # Two launchers of one rank each (nodes 0 and 1): rank 1 is the
        # second launcher's child.
        train(cli, src, base_sets(even_dir, steps) + sets + ["distributed.strategy=ddp"], 2, nodes=2)
        lifted = []

        def throttle(launchers):
            pid = rank_of(launchers[1].pid)
            with open(os.path.join(group, "cpu.cfs_period_us"), "w") as f:
                f.write("100000")
            with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
                f.write("50000")
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(pid))

            def lift():
                path = os.path.join(bal_dir, "metrics.jsonl")
                while True:
                    try:
                        if len(rows(bal_dir)) >= lift_at:
                            break
                    except (OSError, ValueError):
                        pass
                    time.sleep(0.1)
                # Lifted by moving the rank back to the root group: raising
                # the quota alone can leave it in a group the scheduler
                # still places poorly (its share then stays low).
                with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
                    f.write("-1")
                release(group)
                lifted.append(len(rows(bal_dir)))
            threading.Thread(target=lift, daemon=True).start()

        out = train(cli, src, base_sets(bal_dir, steps) + sets + ["distributed.strategy=ddp"] +
                    measured([1, 1], every=3), 2, nodes=2, on_start=throttle)
        series = [r["shares"][1] for r in rows(bal_dir)]
        print("rank 1's share per step:", " ".join(f"{s:.2f}" for s in series))
        print("\n".join(line for line in out.splitlines() if "slower" in line or "recovered" in line
                        or "load balance" in line))
        if not lifted:
            fail("the throttle was never lifted")
        throttled = min(series[:lifted[0]])
        if not 0.2 <= throttled <= 0.45:
            fail(f"throttled to half a core, rank 1's share went down to {throttled:.3f}, expected about 1/3")
        if series[-1] < 0.4:
            fail(f"after the throttle was lifted at step {lifted[0]}, rank 1's share is {series[-1]:.3f} at the end")
        if "rank 1 on host" not in out or "slower than the median" not in out:
            fail("the log does not name rank 1 as slower than the median")
        if "has recovered" not in out:
            fail("the log does not note rank 1's recovery")
        # The first 20 steps within 1e-6; the order of fp32 sums differs, and
        # AdamW grows such differences, so the rest within 1e-4.
        ours, theirs = losses(bal_dir), losses(even_dir)
        worst = same_losses("throttled measured vs even", ours[:STEPS], theirs[:STEPS])
        for i, (o, t) in enumerate(zip(ours, theirs)):
            if abs(o - t) > 1e-4 * abs(t):
                fail(f"throttled measured vs even: step {i + 1} loss {o:.9f}, the even run's {t:.9f}")
        print(f"throttled: share down to {throttled:.3f}, back to {series[-1]:.3f}; named and recovered; "
              f"{STEPS} losses equal the even run's within {RTOL} (largest {worst:.1e}), all {steps} within 1e-4")
    finally:
        release(group)
        for _ in range(50):
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    {"exact": cmd_exact, "edges": cmd_edges, "throttled": cmd_throttled, "nodes": cmd_nodes}[sys.argv[1]](
        sys.argv[2], sys.argv[3])
