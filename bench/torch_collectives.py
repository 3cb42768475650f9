#!/usr/bin/python3
"""PyTorch Gloo peer for `shardtrain bench-comm`.

Run under the shardtrain launcher, which sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (torchrun is broken on this Python):

    shardtrain launch --nproc-per-node 2 -- /usr/bin/python3 bench/torch_collectives.py \
        --op all_reduce --bytes 1M --iters 20 --warmup 5 --json out.jsonl

Same measurement as shardtrain's bench-comm: W untimed warm-up calls, a barrier,
then K timed calls; the time of each iteration is the slowest rank's (an
all_reduce with MAX over the per-iteration times) and the reported time is the
mean over the K iterations. algbw = bytes / time; busbw = algbw * 2(n-1)/n for
all_reduce, * (n-1)/n for reduce_scatter, all_gather and all_to_all, * 1 for
broadcast (nccl-tests definitions). Rank 0 prints one line and appends one JSON line with
"impl":"pytorch-gloo".

Only collectives whose output matches shardtrain's are measured. PyTorch 1.13's
Gloo process group implements neither reduce_scatter (list or tensor form) nor
_all_gather_base / all_gather_into_tensor; all_gather into a list of tensors does
work but copies into separate outputs and is not the same operation
bandwidth-wise, so it is not used. For an unsupported op the script probes the
tensor form once, prints why it is skipped, appends a JSON line with
"status":"unsupported" and exits 0. all_to_all is all_to_all_single with the
same splits as bench-comm's: numel / n elements to each rank, the last part
taking the remainder (1.13 Gloo runs it on CPU tensors, uneven splits too).
"""
import argparse
import json
import sys
import time
import warnings

import torch
import torch.distributed as dist


def parse_bytes(text):
    scales = {"": 1, "K": 1 << 10, "KB": 1 << 10, "k": 1 << 10,
              "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}
    digits = text.rstrip("KMGBk")
    suffix = text[len(digits):]
    if suffix not in scales or not digits:
        raise SystemExit(f"--bytes '{text}' is not a size like 4096, 1K, 64M")
    return int(float(digits) * scales[suffix])


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="all_reduce", choices=OPS)
    p.add_argument("--bytes", default="1M", type=parse_bytes)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--iters", default=20, type=int)
    p.add_argument("--warmup", default=5, type=int)
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.iters <= 0 or args.warmup < 0:
        raise SystemExit("--iters must be positive and --warmup >= 0")

    torch.set_num_threads(1)
    # 1.13 warns on every call of the private flat forms used by the probe below.
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    dist.init_process_group("gloo")  # env:// from the launcher's variables
    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    esize = torch.tensor([], dtype=dtype).element_size()
    numel = 0 if args.op == "barrier" else max(1, args.bytes // esize)
    nbytes = numel * esize
    full = torch.ones(numel, dtype=dtype)
    # all_to_all: part j of `full` goes to rank j; each rank receives its own
    # part's size from every rank.
    send_parts = [numel // n] * (n - 1) + [numel - (n - 1) * (numel // n)]
    recv_parts = [send_parts[rank]] * n
    received = torch.ones(sum(recv_parts) if args.op == "all_to_all" else 0, dtype=dtype)

    def record(line):
        if rank == 0 and args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")

    if args.op in ("reduce_scatter", "all_gather"):
        # Probe the flat-tensor forms; on 1.13 Gloo both raise. Every rank raises
        # the same way, so nobody is left waiting.
        reason = None
        try:
            if n > 1 and numel % n == 0:
                shard = torch.ones(numel // n, dtype=dtype)
                if args.op == "reduce_scatter":
                    dist.reduce_scatter_tensor(shard, full)
                else:
                    dist.all_gather_into_tensor(full, shard)
            else:
                reason = "uneven split; flat-tensor form needs numel divisible by world size"
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            reason = str(e).strip().splitlines()[0]
        if reason is not None and args.op == "reduce_scatter" and n > 1 and numel % n == 0:
            # The list form takes views of one buffer as inputs: the same operation.
            try:
                dist.reduce_scatter(torch.ones(numel // n, dtype=dtype), list(full.chunk(n)))
                reason += "; list form works here but is not measured; extend this script"
            except (RuntimeError, NotImplementedError) as e:
                reason += "; list form: " + str(e).strip().splitlines()[0]
        if reason is None:
            reason = ("flat form works here, but this script only measures the ops "
                      "known to work on PyTorch 1.13 Gloo; extend it")
        if rank == 0:
            print(f"{args.op:<15} {args.dtype:<9} {nbytes:12d} bytes  {n:2d} ranks  "
                  f"skipped: PyTorch {torch.__version__} Gloo: {reason}")
        record({"impl": "pytorch-gloo", "op": args.op, "dtype": args.dtype, "bytes": nbytes,
                "world_size": n, "status": "unsupported", "reason": reason})
        dist.destroy_process_group()
        return 0

    def run_once():
        if args.op == "all_reduce":
            dist.all_reduce(full)
        elif args.op == "barrier":
            dist.barrier()
        elif args.op == "all_to_all":
            dist.all_to_all_single(received, full, recv_parts, send_parts)
        else:
            dist.broadcast(full, src=0)

    for _ in range(args.warmup):
        run_once()
    dist.barrier()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        run_once()
        times.append(time.perf_counter() - t0)
    # The slowest rank defines each iteration's time (as in shardtrain bench-comm).
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    avg_s = t.mean().item()
    algbw = nbytes / avg_s / 1e9
    factor = {"all_reduce": 2.0 * (n - 1) / n, "broadcast": 1.0}.get(args.op, (n - 1) / n)
    busbw = algbw * factor
    if rank == 0:
        print(f"{args.op:<15} {args.dtype:<9} {nbytes:12d} bytes  {n:2d} ranks  "
              f"{avg_s * 1e6:10.1f} us  algbw {algbw:8.3f} GB/s  busbw {busbw:8.3f} GB/s")
    record({"impl": "pytorch-gloo", "op": args.op, "dtype": args.dtype, "bytes": nbytes,
            "world_size": n, "iters": args.iters, "time_us": avg_s * 1e6,
            "algbw_gbps": algbw, "busbw_gbps": busbw})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
