#!/usr/bin/python3
"""PyTorch peer for `shardtrain train` with model.type=llama: the same Llama
decoder, data, batch and optimizer, trained with PyTorch (DDP over Gloo on CPU
when world size > 1).

Run one process directly (world size 1), or several under the shardtrain
launcher, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun is
broken on this Python):

    /usr/bin/python3 bench/torch_llama_ddp.py --threads 2 --steps 10 --warmup 3
    shardtrain launch --nproc-per-node 2 -- /usr/bin/python3 bench/torch_llama_ddp.py \
        --threads 1 --steps 10 --warmup 3 --json out.jsonl

Everything but the model is bench/torch_gpt_ddp.py's (its flags, timing,
profile format, teardown and JSON line; its helpers are imported from it):
data/corpus.txt as bytes (vocab 256), random windows of block_size + 1 bytes
per micro-batch from the first (1 - val_fraction) of the file, a different
stream per rank; mean cross entropy; AdamW (decay on dim >= 2 parameters only,
betas 0.9/0.95, eps 1e-8); warmup + cosine learning rate; clipping at 1.0;
DDP with 25 MB buckets and no_sync() on all but the last micro-step; --zero1
wraps AdamW in ZeroRedundancyOptimizer; --bf16 runs forward and loss under
torch.autocast("cpu", dtype=torch.bfloat16).

The model is tests/reference/llama_ref.py's LlamaRef (Hugging Face's
LlamaForCausalLM maths: RMSNorm in fp32, rotate-half rotary embeddings,
grouped-query attention, SwiGLU MLP), initialised as transformers does:
every Linear and the embedding normal(0, 0.02), RMSNorm weights 1, from
torch.manual_seed(--seed). The defaults are the llama-25m shape: 8 layers,
hidden 512, 8 heads, 2 key/value heads (head_dim 64), intermediate 1408,
vocab 256, untied lm_head (22.8M parameters), block 256, global batch 8,
micro 2 (bench/train.sh's gpt-25m batch).

The JSON line has the GPT peer's keys (n_head, n_embd, ...) plus "model":
"llama", "n_kv_head", "head_dim", "intermediate_size", "tie_word_embeddings".
"""
import argparse
import faulthandler
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llama_ref import LlamaRef, RMSNorm  # noqa: E402
from torch_gpt_ddp import (_null, _null_scope, blas_core, blas_threads, lr_at,  # noqa: E402
                           write_profile)


def build_model(a):
    config = {
        "model_type": "llama", "vocab_size": a.vocab_size, "hidden_size": a.n_embd,
        "intermediate_size": a.intermediate_size, "num_hidden_layers": a.n_layer,
        "num_attention_heads": a.n_head, "num_key_value_heads": a.n_kv_head or a.n_head,
        "head_dim": a.head_dim or a.n_embd // a.n_head, "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta, "tie_word_embeddings": a.tie, "attention_bias": False,
        "max_position_embeddings": a.block_size,
    }
    model = LlamaRef(config)
    with torch.no_grad():  # transformers' _init_weights with initializer_range 0.02
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
    return model, config


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-kv-head", type=int, default=2, help="key/value heads; 0: n_head")
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=0, help="0: n_embd / n_head")
    p.add_argument("--intermediate-size", type=int, default=1408)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rms-norm-eps", type=float, default=1e-5)
    p.add_argument("--tie", action="store_true", help="tie lm_head to embed_tokens")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps in all")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
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
    p.add_argument("--profile-out", default="",
                   help="profile JSON path; '{rank}' is replaced by the rank")
    a = p.parse_args()
    if a.profile_step and not (1 <= a.profile_step <= a.steps and a.profile_out):
        sys.exit("torch_llama_ddp.py: --profile-step needs 1 <= N <= --steps and --profile-out")
    if a.steps <= a.warmup or a.warmup < 0:
        sys.exit("torch_llama_ddp.py: need 0 <= --warmup < --steps")

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    threads = a.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    if a.zero1 and world < 2:
        sys.exit("torch_llama_ddp.py: --zero1 needs world size > 1; start it under `shardtrain launch`")
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)

    if a.global_batch % (a.micro * world):
        sys.exit(f"torch_llama_ddp.py: global batch {a.global_batch} is not divisible by "
                 f"micro {a.micro} x world {world}")
    accumulate = a.global_batch // (a.micro * world)

    with open(a.data, "rb") as f:
        raw = f.read()
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    n_train = int(len(tokens) * (1.0 - a.val_fraction))
    train = tokens[:n_train]
    if n_train <= a.block_size + 1:
        sys.exit(f"torch_llama_ddp.py: {a.data} is too short for block size {a.block_size}")
    offsets = torch.arange(a.block_size + 1)
    gen = torch.Generator().manual_seed(a.seed + 1000 * rank)

    def batch():
        starts = torch.randint(0, n_train - a.block_size - 1, (a.micro, 1), generator=gen)
        w = train[starts + offsets]
        return w[:, :-1], w[:, 1:]

    torch.manual_seed(a.seed)  # same weights on every rank (DDP also broadcasts them)
    model, config = build_model(a)
    params = list(model.parameters())
    n_params = sum(t.numel() for t in params)
    decay = [t for t in params if t.dim() >= 2]
    no_decay = [t for t in params if t.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if a.zero1:
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

    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    measured = times[a.warmup:]
    step_time = statistics.median(measured)
    tokens_per_step = a.global_batch * a.block_size
    result = {
        "impl": "pytorch", "model": "llama", "label": a.label, "mode": a.mode, "torch": torch.__version__,
        "strategy": ("zero1" if a.zero1 else "ddp") if world > 1 else "single", "world_size": world,
        "threads_per_rank": threads, "n_layer": a.n_layer, "n_head": a.n_head,
        "n_kv_head": config["num_key_value_heads"], "head_dim": config["head_dim"],
        "n_embd": a.n_embd, "intermediate_size": a.intermediate_size,
        "tie_word_embeddings": a.tie,
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
    }
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")
    if world > 1:
        faulthandler.dump_traceback_later(a.teardown_timeout, exit=True)  # see torch_gpt_ddp.py
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
