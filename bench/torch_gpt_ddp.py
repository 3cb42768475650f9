#!/usr/bin/python3
"""PyTorch peer for `shardtrain train`: the same GPT, data, batch and optimizer.

Run one process directly (world size 1), or several under the shardtrain
launcher, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun is
broken on this Python):

    /usr/bin/python3 bench/torch_gpt_ddp.py --threads 2 --steps 30 --warmup 10
    shardtrain launch --nproc-per-node 2 -- /usr/bin/python3 bench/torch_gpt_ddp.py \
        --threads 1 --steps 30 --warmup 10 --json out.jsonl

The model is src/models/gpt.cpp written in PyTorch: token + position
embeddings, pre-LayerNorm blocks (eps 1e-5) with a fused c_attn, a causal mask
built per forward (ones().triu(1) + masked_fill(-inf)) and softmax, a GELU
(tanh) MLP, a final LayerNorm and an output projection tied to wte; loss is
the mean cross entropy. AdamW (decay 0.1 on dim >= 2 parameters only, betas
0.9/0.95, eps 1e-8), warmup + cosine learning rate, gradient clipping at 1.0.
With world size > 1 the model is wrapped in DistributedDataParallel (Gloo, CPU,
25 MB buckets, 1 MB first bucket: PyTorch's defaults, which shardtrain copies)
and every accumulation micro-step but the last runs under no_sync().
With --zero1 (world size > 1 only) the AdamW is wrapped in
torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO-1: each rank keeps the
Adam state of its share of the parameters, steps it, and broadcasts the
updated parameters), with the same parameter groups and hyper-parameters;
gradients are still all-reduced by DDP, as above. Without it (the default,
what bench/train.sh runs) the optimizer is a plain AdamW on every rank.

With --bf16 the forward pass and the loss run under
torch.autocast("cpu", dtype=torch.bfloat16) (bf16 matmuls, fp32 weights,
gradients and optimizer: PyTorch's counterpart of shardtrain's
precision=bf16-mixed); backward runs outside autocast, as PyTorch recommends.

Data: data/corpus.txt read as bytes (vocab 256); micro-batches are random
windows of block_size + 1 bytes from the first (1 - val_fraction) of the file,
a different stream per rank.

Timing mirrors shardtrain's trainer: a step is timed from the first
micro-batch's data fetch to zero_grad() after the optimizer step (the loss's
.item() inside, as shardtrain does), per rank; a step's time is the slowest
rank's (all_reduce MAX, outside the timed region). The first --warmup steps are
not measured; step_time_s is the median over the rest and tokens_per_s =
global_batch * block_size / step_time_s. peak_rss_mb is ru_maxrss of each rank
at the end, max over ranks. Rank 0 prints one JSON line and appends it to
--json when given.

--profile-step N (1-based, as shardtrain's step numbers) profiles optimizer
step N with torch.autograd.profiler.profile() (record_shapes off) and writes,
on every rank, --profile-out with "rank<R>" put in place of "{rank}" (or
-rank<R> appended before .json when there is no "{rank}"):

    {"impl":"pytorch","step":N,"rank":R,"step_us":..,
     "scopes":[{"name":"forward"|"backward"|"clip"|"optimizer","total_us":..}],
     "ops":[{"name":"aten::addmm","scope":"forward"|..|"other","self_us":..,"calls":..}]}

the format shardtrain's trainer.profile_step writes. The step is wrapped in
record_function("forward") (model and loss, per micro-batch), "backward",
"clip" and "optimizer" (step and zero_grad); an op's scope is the nearest of
these on its cpu_parent chain ("other": none, e.g. the data fetch), self_us
its exclusive CPU time (FunctionEvent.self_cpu_time_total) summed over its
calls in that scope. DDP waits for its gradient all-reduce inside backward, so
there is no "sync" scope. step_us is the step's wall time under the profiler
(which slows it): profile a separate run, not a timed one.

Teardown (barrier, destroy_process_group, interpreter exit) runs after the
result is written and is given --teardown-timeout seconds: Gloo's teardown
occasionally hangs (pytorch/pytorch#75097; seen once here on a loaded machine),
and then faulthandler prints every thread's stack and the rank exits with
code 1 instead of stalling the benchmark until its time limit.
"""
import argparse
import faulthandler
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        hs = c // self.n_head
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, hs).transpose(1, 2)
        k = k.view(b, t, self.n_head, hs).transpose(1, 2)
        v = v.view(b, t, self.n_head, hs).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(future, float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        # GPT-2 initialisation, as src/models/gpt.cpp.
        std, proj_std = 0.02, 0.02 / math.sqrt(2.0 * n_layer)
        with torch.no_grad():
            nn.init.normal_(self.wte.weight, 0.0, std)
            nn.init.normal_(self.wpe.weight, 0.0, std)
            for blk in self.h:
                for lin, s in ((blk.attn.c_attn, std), (blk.attn.c_proj, proj_std),
                               (blk.mlp.c_fc, std), (blk.mlp.c_proj, proj_std)):
                    nn.init.normal_(lin.weight, 0.0, s)
                    nn.init.zeros_(lin.bias)

    def forward(self, idx):
        t = idx.size(1)
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        x = self.ln_f(x)
        return F.linear(x, self.wte.weight)  # tied output projection


def lr_at(step, a):
    """shardtrain's default schedule: linear warmup, then cosine to min_lr at max_steps."""
    if step < a.lr_warmup:
        return a.lr * (step + 1) / a.lr_warmup
    if a.steps <= a.lr_warmup:
        return a.lr
    p = min(1.0, (step - a.lr_warmup) / max(1, a.steps - a.lr_warmup))
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1.0 + math.cos(math.pi * p))


def gpt_args(p):
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)


def build_gpt(a):
    """The model and what the JSON line says of it beyond the common keys."""
    return GPT(a.n_layer, a.n_head, a.n_embd, a.block_size, a.vocab_size), {}


def main(prog="torch_gpt_ddp.py", doc=__doc__, model_args=gpt_args, build=build_gpt, **defaults):
    """The benchmark loop for any model: `model_args` adds the model's flags,
    `build(a)` returns (model, extra JSON keys), `defaults` override the
    common flags' defaults (bench/torch_llama_ddp.py runs it this way)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    model_args(p)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps in all")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the timing")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank; 0: cores / ranks")
    p.add_argument("--data", default="data/corpus.txt")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--lr-warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--label", default="", help="copied into the JSON line")
    p.add_argument("--mode", default="", help="copied into the JSON line (bench/train.sh's mode name)")
    p.add_argument("--json", default="", help="append the result line to this file (rank 0)")
    p.add_argument("--teardown-timeout", type=float, default=60.0,
                   help="seconds teardown may take after the result is written (world size > 1)")
    p.add_argument("--zero1", action="store_true",
                   help="wrap AdamW in ZeroRedundancyOptimizer (needs world size > 1)")
    p.add_argument("--bf16", action="store_true",
                   help="forward and loss under torch.autocast('cpu', dtype=torch.bfloat16)")
    p.add_argument("--profile-step", type=int, default=0,
                   help="profile this optimizer step (1-based; 0: off) into --profile-out")
    p.add_argument("--first-step-line", action="store_true",
                   help="rank 0 prints a line as soon as the first step is done (bench/first_step.py)")
    p.add_argument("--profile-out", default="",
                   help="profile JSON path; '{rank}' is replaced by the rank")
    p.set_defaults(**defaults)
    a = p.parse_args()
    if a.profile_step and not (1 <= a.profile_step <= a.steps and a.profile_out):
        sys.exit(f"{prog}: --profile-step needs 1 <= N <= --steps and --profile-out")
    if a.steps <= a.warmup or a.warmup < 0:
        sys.exit(f"{prog}: need 0 <= --warmup < --steps")

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    threads = a.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    if a.zero1 and world < 2:
        sys.exit(f"{prog}: --zero1 needs world size > 1; start it under `shardtrain launch`")
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)

    if a.global_batch % (a.micro * world):
        sys.exit(f"{prog}: global batch {a.global_batch} is not divisible by "
                 f"micro {a.micro} x world {world}")
    accumulate = a.global_batch // (a.micro * world)

    with open(a.data, "rb") as f:
        raw = f.read()
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    n_train = int(len(tokens) * (1.0 - a.val_fraction))
    train = tokens[:n_train]
    if n_train <= a.block_size + 1:
        sys.exit(f"{prog}: {a.data} is too short for block size {a.block_size}")
    offsets = torch.arange(a.block_size + 1)
    gen = torch.Generator().manual_seed(a.seed + 1000 * rank)

    def batch():
        starts = torch.randint(0, n_train - a.block_size - 1, (a.micro, 1), generator=gen)
        w = train[starts + offsets]
        return w[:, :-1], w[:, 1:]

    torch.manual_seed(a.seed)  # same weights on every rank (DDP also broadcasts them)
    model, about_model = build(a)
    params = list(model.parameters())  # tied weights counted once
    n_params = sum(t.numel() for t in params)
    decay = [t for t in params if t.dim() >= 2]
    no_decay = [t for t in params if t.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if a.zero1:
        # Same groups and hyper-parameters; the learning rate set on
        # opt.param_groups below is copied to the local AdamW at each step().
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW,
                                      lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    else:
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    ddp = None
    if world > 1:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    net = ddp if ddp is not None else model

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if a.bf16 else _null()

    times, losses = [], []
    for step in range(a.steps):
        profiling = step + 1 == a.profile_step
        prof = torch.autograd.profiler.profile(record_shapes=False) if profiling else _null()
        scope = torch.autograd.profiler.record_function if profiling else _null_scope
        with prof:
            t0 = time.perf_counter()
            loss_sum = 0.0
            for j in range(accumulate):
                x, y = batch()
                sync = j == accumulate - 1
                ctx = net.no_sync() if (ddp is not None and not sync) else _null()
                with ctx:
                    with scope("forward"), autocast():
                        logits = net(x)
                        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
                    with scope("backward"):
                        (loss / accumulate).backward()
                loss_sum += loss.item()
            if a.max_grad_norm > 0:
                with scope("clip"):
                    torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
            lr = lr_at(step, a)
            for g in opt.param_groups:
                g["lr"] = lr
            with scope("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=False)
            dt = time.perf_counter() - t0
        if profiling:
            write_profile(prof, a, rank, step + 1, dt)
        stat = torch.tensor([dt, loss_sum / accumulate], dtype=torch.float64)
        if world > 1:
            slow = stat[:1].clone()
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)
            dist.all_reduce(stat[1:], op=dist.ReduceOp.SUM)
            stat[0] = slow[0]
            stat[1] /= world
        times.append(stat[0].item())
        losses.append(stat[1].item())
        if step == 0 and rank == 0 and a.first_step_line:
            # bench/first_step.py times the job from its start to this line.
            print(f"first step done in {times[0]:.4f} s", flush=True)

    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    measured = times[a.warmup:]
    step_time = statistics.median(measured)
    tokens_per_step = a.global_batch * a.block_size
    result = {
        "impl": "pytorch", "label": a.label, "mode": a.mode, "torch": torch.__version__,
        "strategy": ("zero1" if a.zero1 else "ddp") if world > 1 else "single", "world_size": world,
        "threads_per_rank": threads, "n_layer": a.n_layer, "n_head": a.n_head, "n_embd": a.n_embd,
        "block_size": a.block_size, "vocab_size": a.vocab_size, "num_parameters": n_params,
        "global_batch": a.global_batch, "micro": a.micro, "accumulate": accumulate,
        "steps": a.steps, "measured_steps": len(measured),
        "step_time_s": step_time, "step_time_mean_s": statistics.mean(measured),
        "tokens_per_s": tokens_per_step / step_time,
        "peak_rss_mb": rss.item(), "first_loss": losses[0], "last_loss": losses[-1],
        "precision": "bf16-autocast" if a.bf16 else "fp32",
        "blas_core": blas_core(), "blas_threads": blas_threads(),
        "env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS",
                                           "OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ},
        **about_model,
    }
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")
    if world > 1:
        faulthandler.dump_traceback_later(a.teardown_timeout, exit=True)  # see the docstring
        dist.barrier()
        dist.destroy_process_group()


SCOPES = ("forward", "backward", "clip", "optimizer")


def write_profile(prof, a, rank, step, step_s):
    """Writes the profiled step in shardtrain's profile-rank<R>.json format
    (see the docstring)."""
    scopes, ops = {}, {}
    for ev in prof.function_events:
        if ev.name in SCOPES:
            scopes[ev.name] = scopes.get(ev.name, 0.0) + ev.cpu_time_total
            continue
        parent, where = ev.cpu_parent, "other"
        while parent is not None:
            if parent.name in SCOPES:
                where = parent.name
                break
            parent = parent.cpu_parent
        o = ops.setdefault((ev.name, where), {"name": ev.name, "scope": where, "self_us": 0.0, "calls": 0})
        o["self_us"] += ev.self_cpu_time_total
        o["calls"] += 1
    out = {"impl": "pytorch", "step": step, "rank": rank, "step_us": step_s * 1e6,
           "scopes": [{"name": n, "total_us": scopes[n]} for n in SCOPES if n in scopes],
           "ops": sorted(ops.values(), key=lambda o: -o["self_us"])}
    path = a.profile_out
    if "{rank}" in path:
        path = path.replace("{rank}", f"rank{rank}")
    else:
        path = (path[:-5] if path.endswith(".json") else path) + f"-rank{rank}.json"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"torch_gpt_ddp.py: rank {rank}: profile of step {step} in {path}", flush=True)


def _openblas():
    """The process's OpenBLAS (LibTorch's BLAS), or None when it is another BLAS."""
    import ctypes
    for name in ("libblas.so.3", "libopenblas.so.0"):
        try:
            lib = ctypes.CDLL(name)
            lib.openblas_get_corename.restype = ctypes.c_char_p
            return lib
        except (OSError, AttributeError):
            continue
    return None


def blas_core():
    """The OpenBLAS kernel set in use ("SkylakeX", "Haswell", ...); "" when not OpenBLAS."""
    lib = _openblas()
    return lib.openblas_get_corename().decode() if lib else ""


def blas_threads():
    lib = _openblas()
    return lib.openblas_get_num_threads() if lib else None


def _null_scope(name):
    return _null()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
