#!/usr/bin/python3
"""An independent PyTorch reference of shardtrain's GPT family (the GPT-2 /
nanoGPT decoder), for checking its C++ model, its safetensors loading and
export, and its trainer. Written from the architecture's definition with
only torch (Debian's python3-torch 1.13) and the standard library; the
trainer's data order, schedule, clipping and loop are llama_ref.py's (one
copy of the trainer's semantics, whichever family trains).

Run it with the system Python: /usr/bin/python3 tests/reference/gpt_ref.py ...

    make FILE --n_layer L --n_head H --n_embd C --block_size T --vocab_size V [--seed S]
                                      write random weights as model.init_from reads them
    train FILE --steps N --data CORPUS --block-size T --global-batch G --micro M
          [--eval-rows R] [--warmup W] [--max-grad-norm X] [...] --out OUT.json
          [--out-weights OUT.safetensors]
                                      llama_ref.py's training loop on that model (the
                                      sizes come from FILE's shapes, n_head from
                                      make's metadata or --n_head)
    selfcheck                         the reference against hand-computed facts

The architecture:

    x = wte[idx] + wpe[position]                     position 0..T-1 (T <= block_size)
    per block h.N:
        x = x + attn.c_proj(attention(attn.c_attn(ln_1(x))))
        x = x + mlp.c_proj(gelu_tanh(mlp.c_fc(ln_2(x))))
    logits = ln_f(x) @ wte.weight^T                   (the head is tied, no lm_head)

c_attn's output is q | k | v (C each), every head of size C / n_head;
attention is causal softmax(q k^T / sqrt(head size)) v; every Linear has a
bias; LayerNorm: (x - mean) / sqrt(biased variance + 1e-5) * weight + bias;
gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

The file layout (src/models/gpt.cpp's family and src/models/hf_dir.cpp's
load_hf_weights and save_hf_dir): one safetensors file whose names are the
C++ model's named_parameters() -- Hugging Face GPT-2's names WITHOUT
GPT2LMHeadModel's "transformer." prefix:

    wte.weight [V, C]   wpe.weight [block_size, C]   ln_f.weight, ln_f.bias [C]
    h.N.ln_1.weight, h.N.ln_1.bias, h.N.ln_2.weight, h.N.ln_2.bias [C]
    h.N.attn.c_attn.weight [C, 3C]   h.N.attn.c_attn.bias [3C]
    h.N.attn.c_proj.weight [C, C]    h.N.attn.c_proj.bias [C]
    h.N.mlp.c_fc.weight [C, 4C]      h.N.mlp.c_fc.bias [4C]
    h.N.mlp.c_proj.weight [4C, C]    h.N.mlp.c_proj.bias [C]

The four projection weights are stored as GPT-2's Conv1D keeps them,
[in, out] (checkpoint::is_conv1d_weight), the transpose of the Linear's
[out, in] that the model (this one and the C++ one) computes with; no
lm_head.weight (tied). A GPT run exports the same layout to
RUN_DIR/model/model.safetensors (no config.json: the GPT family has none),
linked as RUN_DIR/model.safetensors; that is what `train --out-weights`
writes.
"""
import argparse
import math
import os
import sys
import tempfile
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_ref import (WindowSampler, _split, _write_json, lm_train_tokens, read_safetensors,  # noqa: E402
                       read_tokens, train, write_safetensors)

LAYER_NORM_EPS = 1e-5
# The weights stored [in, out] (Conv1D) in files, [out, in] in the model.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def is_conv1d(name):
    return name.endswith(CONV1D)


# ---- model -------------------------------------------------------------------------------

def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)  # biased, as LayerNorm's definition
        return (x - mean) / torch.sqrt(var + LAYER_NORM_EPS) * self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, c, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)

    def forward(self, x, mask):
        """mask [B, T, T] bool (True: may attend)."""
        b, t, c = x.shape
        d = c // self.n_head
        q, k, v = (y.view(b, t, self.n_head, d).transpose(1, 2) for y in self.c_attn(x).split(c, dim=2))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        y = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c)
        self.c_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(gelu_tanh(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c, n_head):
        super().__init__()
        self.ln_1 = LayerNorm(c)
        self.attn = Attention(c, n_head)
        self.ln_2 = LayerNorm(c)
        self.mlp = MLP(c)

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPTRef(nn.Module):
    """The GPT decoder with the C++ model's parameter names."""

    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        assert n_embd % n_head == 0, f"n_embd {n_embd} is not divisible by n_head {n_head}"
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = LayerNorm(n_embd)

    def forward(self, idx, position=None, segment=None):
        """idx [B, T] -> logits [B, T, V]. position [B, T] indexes wpe
        (default 0..T-1, or restarting per segment); segment [B, T]: packed
        rows, attention only between equal ids (the signature llama_ref's
        train() calls)."""
        b, t = idx.shape
        assert t <= self.block_size, f"{t} tokens exceed block_size {self.block_size}"
        if position is None:
            position = torch.arange(t).expand(b, t)
            if segment is not None:
                starts = torch.cat((torch.ones(b, 1, dtype=torch.bool), segment[:, 1:] != segment[:, :-1]), 1)
                first = torch.cummax(torch.where(starts, torch.arange(t).expand(b, t), 0), dim=1).values
                position = position - first
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t)
        if segment is not None:
            mask = mask & (segment[:, :, None] == segment[:, None, :])
        x = self.wte(idx) + self.wpe(position)
        for block in self.h:
            x = block(x, mask)
        return F.linear(self.ln_f(x), self.wte.weight)


# ---- files -------------------------------------------------------------------------------

def file_tensors(model):
    """{name: fp32 tensor} of `model` in the file layout (Conv1D weights [in, out])."""
    return {n: (p.detach().t() if is_conv1d(n) else p.detach()).float().contiguous()
            for n, p in model.named_parameters()}


def file_arch(tensors, meta, n_head=0):
    """(n_layer, n_head, n_embd, block_size, vocab_size) of a GPT file: the
    sizes from its shapes, n_head (which no shape shows) from `n_head` or
    the "n_head" that make records in the metadata."""
    n_head = n_head or int(meta.get("n_head", 0))
    assert n_head > 0, "the file does not record n_head: give --n_head"
    n_layer = len({n.split(".")[1] for n in tensors if n.startswith("h.")})
    vocab_size, n_embd = tensors["wte.weight"].shape
    return n_layer, n_head, n_embd, tensors["wpe.weight"].shape[0], vocab_size


def load_model(path, n_head=0):
    """GPTRef (fp32) with the weights of a GPT safetensors file; every
    tensor must be there with its file shape, and nothing else."""
    tensors, meta = read_safetensors(path)
    model = GPTRef(*file_arch(tensors, meta, n_head))
    own = dict(model.named_parameters())
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    assert not missing and not unexpected, f"{path}: missing {missing}, unexpected {unexpected}"
    with torch.no_grad():
        for n, p in own.items():
            t = tensors[n].t() if is_conv1d(n) else tensors[n]
            assert tuple(t.shape) == tuple(p.shape), f"{path}: {n} {list(tensors[n].shape)} in the file"
            p.copy_(t.float())
    return model


def make(path, n_layer, n_head, n_embd, block_size, vocab_size, seed=0):
    """Writes random weights to `path`: matrices and embeddings N(0, 0.02)
    (residual projections 0.02 / sqrt(2 n_layer), as GPT-2 starts), every
    bias N(0, 0.02) and LayerNorm weights 1 + N(0, 0.1), so that a dropped
    bias or affine LayerNorm term changes the result. Drawn in parameter
    order from one torch.Generator().manual_seed(seed). The metadata records
    n_head for `train` (shardtrain reads only the tensors)."""
    model = GPTRef(n_layer, n_head, n_embd, block_size, vocab_size)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("ln_f."):
                base = 1.0 if name.endswith(".weight") else 0.0
                p.copy_(base + (0.1 if name.endswith(".weight") else 0.02) * torch.randn(p.shape, generator=gen))
            elif name.endswith("c_proj.weight"):
                p.copy_(0.02 / math.sqrt(2 * n_layer) * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    write_safetensors(path, file_tensors(model), {"format": "pt", "producer": "gpt_ref.py", "n_head": n_head})
    return model


# ---- CLI ---------------------------------------------------------------------------------

def cmd_make(argv):
    p = argparse.ArgumentParser(prog="gpt_ref.py make", description="Random GPT weights (F32, file layout).")
    p.add_argument("file")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        p.add_argument(f"--{key}", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    make(a.file, a.n_layer, a.n_head, a.n_embd, a.block_size, a.vocab_size, seed=a.seed)


def cmd_train(argv):
    """llama_ref.py train's --data path for a GPT: the same argument names
    and defaults (those of configs/default.yaml), the same loop."""
    p = argparse.ArgumentParser(prog="gpt_ref.py train")
    p.add_argument("file", help="safetensors file with the initial weights (make's layout)")
    p.add_argument("--n_head", type=int, default=0, help="default: the one make recorded in the file")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--data", required=True, help="token file or text (bytes, data.tokenizer=bytes)")
    p.add_argument("--block-size", type=int, required=True, help="model.block_size: the training windows")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--micro", type=int, default=0, help="rows per micro-batch (0: whole step at once)")
    p.add_argument("--seed", type=int, default=1337, help="run.seed (data order)")
    p.add_argument("--no-shuffle", action="store_true", help="data.shuffle=false")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--eval-rows", type=int, default=0,
                   help="micro x data-parallel ranks of the C++ run (sizes the held-out split); default --micro")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--min-lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=20, help="schedule.warmup_steps")
    p.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--max-steps", type=int, default=0, help="trainer.max_steps of the schedule (default --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="-", help="JSON {steps: [{step, loss, lr, grad_norm, targets}], losses: [..]}")
    p.add_argument("--out-weights", default="", help="final parameters, F32, in the file layout")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_model(a.file, a.n_head).train()
    tokens = lm_train_tokens(read_tokens(a.data), a.val_fraction, a.block_size, a.eval_rows or a.micro or a.global_batch)
    sampler = WindowSampler(tokens, a.block_size, a.global_batch, a.seed, not a.no_shuffle)

    def step_batches(s):
        x, y = sampler.global_batch(s)
        return _split({"input": x, "target": y, "position": None, "segment": None}, a.micro)

    records = train(model, step_batches, a)
    if a.out_weights:
        write_safetensors(a.out_weights, file_tensors(model), {"format": "pt", "producer": "gpt_ref.py"})
    _write_json(a.out, {"steps": records, "losses": [r["loss"] for r in records]})


# ---- self-check --------------------------------------------------------------------------

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=12, vocab_size=32)


def random_model(seed=0):
    torch.manual_seed(seed)
    m = GPTRef(**TINY)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_((1.0 if n.endswith("ln_1.weight") or n.endswith("ln_2.weight") or n == "ln_f.weight" else 0.0)
                    + 0.3 * torch.randn(p.shape))
    return m.eval()


class SelfCheck(unittest.TestCase):
    def test_gelu_tanh_known_values(self):
        # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) at x = 1 and -2, by
        # hand; the erf form differs visibly at both.
        x = torch.tensor([1.0, -2.0], dtype=torch.float64)
        want = torch.tensor([0.8411919906082768, -0.04540230591222494], dtype=torch.float64)
        torch.testing.assert_close(gelu_tanh(x), want, rtol=0, atol=1e-12)
        self.assertGreater(float((gelu_tanh(x) - F.gelu(x)).abs().min()), 5e-5)

    def test_layer_norm_known_vector_and_eps(self):
        n = LayerNorm(4)
        with torch.no_grad():
            n.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
            n.bias.copy_(torch.tensor([0.0, 0.1, 0.0, -0.2]))
        x = torch.tensor([1.0, 2.0, 3.0, 4.0])  # mean 2.5, biased variance 1.25
        r = 1.0 / math.sqrt(1.25 + 1e-5)
        want = torch.tensor([-1.5 * r, -0.5 * r * 2 + 0.1, 0.5 * r * 0.5, 1.5 * r * -1.0 - 0.2])
        torch.testing.assert_close(n(x), want, rtol=1e-6, atol=1e-7)
        small = torch.tensor([1e-3, -1e-3, 1e-3, -1e-3])  # variance 1e-6: eps is 1/11 of it
        self.assertAlmostEqual(float(LayerNorm(4)(small)[0]), 1e-3 / math.sqrt(1e-6 + 1e-5), places=5)

    def test_one_position_attends_to_itself(self):
        # Softmax over one key is 1: the output is c_proj(v) of that position.
        m = random_model()
        a = m.h[0].attn
        x = torch.randn(1, 1, TINY["n_embd"])
        v = a.c_attn(x)[..., 2 * TINY["n_embd"]:]
        torch.testing.assert_close(a(x, torch.ones(1, 1, 1, dtype=torch.bool)), a.c_proj(v))

    def test_heads_are_contiguous_slices(self):
        # Head i reads channels [i d, (i+1) d) of q, k and v: attention
        # computed head by head from those slices equals the module's.
        m = random_model()
        a, c, nh = m.h[1].attn, TINY["n_embd"], TINY["n_head"]
        d = c // nh
        x = torch.randn(2, 5, c)
        mask = torch.ones(5, 5, dtype=torch.bool).tril()[None].expand(2, 5, 5)
        q, k, v = a.c_attn(x).split(c, dim=2)
        heads = []
        for i in range(nh):
            s = slice(i * d, (i + 1) * d)
            w = (q[..., s] @ k[..., s].transpose(1, 2) / math.sqrt(d)).masked_fill(~mask, float("-inf"))
            heads.append(torch.softmax(w, -1) @ v[..., s])
        torch.testing.assert_close(a(x, mask), a.c_proj(torch.cat(heads, -1)))

    def test_causal_and_tied_head(self):
        m = random_model()
        idx = torch.randint(0, TINY["vocab_size"], (1, 10))
        other = idx.clone()
        other[0, 6:] = (other[0, 6:] + 1) % TINY["vocab_size"]
        a, b = m(idx), m(other)
        torch.testing.assert_close(a[:, :6], b[:, :6])
        self.assertGreater(float((a[:, 6:] - b[:, 6:]).abs().max()), 1e-3)
        self.assertFalse(any("lm_head" in n for n, _ in m.named_parameters()))

    def test_packed_segments_equal_separate_runs(self):
        m = random_model()
        idx = torch.randint(0, TINY["vocab_size"], (1, 11))
        segment = torch.tensor([[0] * 4 + [1] * 7])
        packed = m(idx, segment=segment)
        torch.testing.assert_close(packed[:, :4], m(idx[:, :4]))
        torch.testing.assert_close(packed[:, 4:], m(idx[:, 4:]))

    def test_file_layout_round_trip(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "w.safetensors")
            model = make(path, **TINY, seed=3)
            tensors, meta = read_safetensors(path)
            c, v = TINY["n_embd"], TINY["vocab_size"]
            self.assertEqual(list(tensors["h.0.attn.c_attn.weight"].shape), [c, 3 * c])
            self.assertEqual(list(tensors["h.1.mlp.c_proj.weight"].shape), [4 * c, c])
            self.assertEqual(list(tensors["wte.weight"].shape), [v, c])
            self.assertEqual(len(tensors), 2 + 2 + 12 * TINY["n_layer"])
            self.assertFalse(any(n.startswith("transformer.") for n in tensors))
            loaded = load_model(path)
            for n, p in model.named_parameters():
                self.assertTrue(torch.equal(p, dict(loaded.named_parameters())[n]), n)
            torch.testing.assert_close(loaded.h[0].attn.c_attn.weight, tensors["h.0.attn.c_attn.weight"].t())


def cmd_selfcheck(argv):
    torch.set_num_threads(1)
    result = unittest.main(module=__name__, argv=["gpt_ref.py selfcheck", *argv], exit=False).result
    sys.exit(0 if result.wasSuccessful() else 1)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cmds = {"make": cmd_make, "train": cmd_train, "selfcheck": cmd_selfcheck}
    if not argv or argv[0] not in cmds:
        sys.exit(__doc__)
    cmds[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
