#!/usr/bin/python3
"""Independent PyTorch reference for the mixture-of-experts decoders
(Mixtral, Qwen3-MoE), written from their published definitions (the
semantics of Hugging Face transformers' MixtralForCausalLM and
Qwen3MoeForCausalLM), for shardtrain's parity tests.

    moe_ref.py make DIR --model_type mixtral|qwen3_moe [--seed S] [--gate_std X] [--dead_expert true] [--KEY JSON ...]
        a random tiny Hugging Face directory (config.json, model.safetensors);
        --KEY sets any config.json key. --dead_expert: 5 experts whose routers
        are [v, -v, w, -w, 0] in every sparse layer, so expert 4 never wins a
        top-2 slot (two of the others always have a logit above 0)
    moe_ref.py logits DIR --tokens IN.json --out OUT.json
        {"logits": [B][T][V]} (IN.json as llama_ref.py's: tokens, positions?, segments?)
    moe_ref.py train DIR --steps N --data FILE --block-size T --global-batch G --micro M
                     [--eval-rows R] [--warmup W] [--out OUT.json] [--out-weights W.safetensors]
        the trainer's loop on the trainer's data order: per step
        {loss (the cross entropy), aux_loss, grad_norm}

Routing: router logits = gate(x); softmax over the experts in fp32; the top
num_experts_per_tok; renormalised to sum 1 (Mixtral always, Qwen3-MoE when
norm_topk_prob); cast back to x's dtype. Each expert runs on the tokens that
chose it (all experts run, those with no token on zero rows, so their
gradients are zeros as in the loop over experts of the published code).

Load balance (the published load_balancing_loss_func, no padding mask): the
router logits of every sparse layer concatenated [L*N, E]; p = softmax;
tokens_per_expert = mean over rows of the one-hot top-k choices [k, E];
aux = E * sum(tokens_per_expert * mean(p)). With output_router_logits the
training loss adds router_aux_loss_coef * aux; with several micro-batches per
step, each micro-batch's aux enters with weight 1 / (micro-batches of the
step), so the step's loss is the cross entropy of the whole batch plus the
coefficient times the mean aux.

The data order, the safetensors files and the optimizer's semantics
(AdamW groups, schedule, clipping) are llama_ref.py's, which models the
trainer's; the architecture here is written anew.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_ref import (IGNORE_INDEX, WindowSampler, _split, clip_grad_norm, lm_train_tokens,  # noqa: E402
                       load_hf_dir, read_tokens, scheduled_lr, write_safetensors)

# ---- config --------------------------------------------------------------------------------

TINY = {
    "mixtral": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 256,
        "hidden_size": 32, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "num_local_experts": 4, "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02, "output_router_logits": False, "tie_word_embeddings": False,
        "hidden_act": "silu", "sliding_window": None, "router_jitter_noise": 0.0,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256,
        "hidden_size": 32, "intermediate_size": 24, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "router_aux_loss_coef": 0.02, "output_router_logits": False, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
    },
}


class Cfg:
    def __init__(self, c):
        self.raw = dict(c)
        self.kind = c["model_type"]
        assert self.kind in TINY, f"model_type {self.kind!r} is neither mixtral nor qwen3_moe"
        self.vocab = c["vocab_size"]
        self.hidden = c["hidden_size"]
        self.layers = c["num_hidden_layers"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.theta = c.get("rope_theta", 10000.0)
        self.top_k = c["num_experts_per_tok"]
        self.tied = bool(c.get("tie_word_embeddings", False))
        self.bias = bool(c.get("attention_bias", False))
        self.aux_coef = float(c.get("router_aux_loss_coef", 0.0))
        self.aux_on = bool(c.get("output_router_logits", False))
        if self.kind == "mixtral":
            self.experts = c["num_local_experts"]
            self.expert_size = c["intermediate_size"]
            self.renorm = True
            self.qk_norm = False
            self.sparse = [True] * self.layers
        else:
            self.experts = c["num_experts"]
            self.expert_size = c["moe_intermediate_size"]
            self.renorm = bool(c.get("norm_topk_prob", False))
            self.qk_norm = True
            step = c.get("decoder_sparse_step", 1)
            only = c.get("mlp_only_layers") or []
            self.sparse = [(i not in only) and self.experts > 0 and (i + 1) % step == 0
                           for i in range(self.layers)]
        self.dense_size = c["intermediate_size"]


# ---- layers --------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(cfg, position):
    """cos, sin [B, T, d] at `position` [B, T]."""
    inv = 1.0 / (cfg.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    angles = position.float()[..., None] * inv  # [B, T, d/2]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rotate(x, cos, sin):
    """x [B, H, T, d]: each head's first half paired with its second half."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * d, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.heads * d, cfg.hidden, bias=cfg.bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.eps)
            self.k_norm = RMSNorm(d, cfg.eps)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, d)
        k = self.k_proj(x).view(b, t, -1, d)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        if self.cfg.qk_norm:  # Qwen3: per head, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        group = self.cfg.heads // self.cfg.kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + mask
        y = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) under either family's names."""

    def __init__(self, hidden, width, names):
        super().__init__()
        self.names = names
        for n, (i, o) in zip(names, ((hidden, width), (width, hidden), (hidden, width))):
            setattr(self, n, nn.Linear(i, o, bias=False))

    def forward(self, x):
        gate, down, up = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class SparseMoe(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        names = ("w1", "w2", "w3") if cfg.kind == "mixtral" else ("gate_proj", "down_proj", "up_proj")
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden, cfg.expert_size, names) for _ in range(cfg.experts))

    def forward(self, x):
        b, t, c = x.shape
        flat = x.reshape(-1, c)
        router_logits = self.gate(flat)
        weights = torch.softmax(router_logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.cfg.top_k, dim=-1)
        if self.cfg.renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        mask = F.one_hot(chosen, num_classes=self.cfg.experts).permute(2, 1, 0)  # [E, k, N]
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            y = expert(flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out.view(b, t, c), router_logits


class Layer(nn.Module):
    def __init__(self, cfg, sparse):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.sparse = sparse
        block = SparseMoe(cfg) if sparse else SwiGLU(cfg.hidden, cfg.dense_size,
                                                     ("gate_proj", "down_proj", "up_proj"))
        self.block_name = "block_sparse_moe" if cfg.kind == "mixtral" else "mlp"
        setattr(self, self.block_name, block)

    def forward(self, x, cos, sin, mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        n = self.post_attention_layernorm(h)
        block = getattr(self, self.block_name)
        if self.sparse:
            y, logits = block(n)
            return h + y, logits
        return h + block(n), None


class Body(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg, s) for s in cfg.sparse)
        self.norm = RMSNorm(cfg.hidden, cfg.eps)


class MoeRef(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.cfg = Cfg(config)
        self.model = Body(self.cfg)
        if not self.cfg.tied:
            self.lm_head = nn.Linear(self.cfg.hidden, self.cfg.vocab, bias=False)

    def state_tensors(self):
        """{HF name: parameter}."""
        return dict(self.named_parameters())

    def forward(self, idx, position=None, segment=None):
        """(logits [B, T, V], router logits of each sparse layer [B*T, E])."""
        b, t = idx.shape
        if position is None:
            position = torch.arange(t).expand(b, t)
        allowed = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
        if segment is not None:
            allowed = allowed & (segment[:, :, None] == segment[:, None, :])
        mask = torch.zeros(b, 1, t, t).masked_fill(~allowed[:, None], float("-inf"))
        cos, sin = rotary(self.cfg, position)
        h = self.model.embed_tokens(idx)
        routers = []
        for layer in self.model.layers:
            h, logits = layer(h, cos, sin, mask)
            if logits is not None:
                routers.append(logits)
        h = self.model.norm(h)
        head = self.model.embed_tokens.weight if self.cfg.tied else self.lm_head.weight
        return h @ head.t(), routers


def load_balancing_loss(router_logits, experts, top_k):
    """The published definition: layers concatenated, no padding mask."""
    if not router_logits:
        return None
    logits = torch.cat(router_logits, dim=0)
    probs = torch.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    tokens_per_expert = F.one_hot(chosen, experts).float().mean(dim=0)  # [k, E]
    prob_per_expert = probs.mean(dim=0)                                  # [E]
    return (tokens_per_expert * prob_per_expert[None]).sum() * experts


def load_model(path):
    config, tensors = load_hf_dir(path)
    model = MoeRef(config)
    own = model.state_tensors()
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    assert not missing and not extra, f"{path}: missing {missing[:4]}, unexpected {extra[:4]}"
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(tensors[n].float())
    return model


# ---- make ------------------------------------------------------------------------------------

def make_tiny(path, kind, seed=0, gate_std=1.0, dead_expert=False, **overrides):
    c = dict(TINY[kind])
    c.update(overrides)
    if dead_expert:
        c["num_local_experts" if kind == "mixtral" else "num_experts"] = 5
        c["num_experts_per_tok"] = 2
    c["torch_dtype"] = "float32"
    model = MoeRef(c)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.state_tensors().items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".gate.weight"):
            # Wide routers, so no two experts' probabilities come within
            # rounding of each other and both implementations pick alike.
            t = gate_std * torch.randn(p.shape, generator=gen)
            if dead_expert:
                v, w = t[0].clone(), t[2].clone()
                t = torch.stack((v, -v, w, -w, torch.zeros_like(v)))
        else:
            t = 0.02 * torch.randn(p.shape, generator=gen)
        tensors[name] = t
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")
    write_safetensors(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})
    return c


# ---- train -----------------------------------------------------------------------------------

def train(model, step_batches, a):
    cfg = model.cfg
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    coef = cfg.aux_coef if cfg.aux_on else 0.0
    records = []
    for step in range(a.steps):
        micro_batches = step_batches(step)
        total = sum(int((b["target"] != IGNORE_INDEX).sum()) for b in micro_batches)
        loss_sum, aux_values = 0.0, []
        for b in micro_batches:
            logits, routers = model(b["input"], b["position"], b["segment"])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["target"].reshape(-1),
                                   reduction="sum", ignore_index=IGNORE_INDEX)
            aux = load_balancing_loss(routers, cfg.experts, cfg.top_k)
            objective = loss / total
            if aux is not None:
                aux_values.append(float(aux))
                if coef > 0:
                    objective = objective + coef * aux / len(micro_batches)
            objective.backward()
            loss_sum += float(loss)
        norm = clip_grad_norm(params, a.max_grad_norm)
        lr = scheduled_lr(step, a.lr, a.min_lr, a.warmup, a.steps, "cosine")
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=False)
        records.append({"step": step + 1, "loss": loss_sum / total, "grad_norm": norm,
                        "aux_loss": sum(aux_values) / len(aux_values) if aux_values else None})
    return records


# ---- CLI -------------------------------------------------------------------------------------

def cmd_make(argv):
    if not argv or argv[0].startswith("--"):
        sys.exit("usage: moe_ref.py make DIR --model_type mixtral|qwen3_moe [--KEY JSON ...]")
    path, rest = argv[0], argv[1:]
    opts = {"seed": 0, "gate_std": 1.0, "dead_expert": False}
    overrides = {}
    for i in range(0, len(rest), 2):
        key, val = rest[i][2:], json.loads(rest[i + 1]) if rest[i + 1][:1] in "[{0123456789-tfn" else rest[i + 1]
        if key in opts:
            opts[key] = val
        else:
            overrides[key] = val
    kind = overrides.pop("model_type", "mixtral")
    c = make_tiny(path, kind, seed=int(opts["seed"]), gate_std=float(opts["gate_std"]),
                  dead_expert=bool(opts["dead_expert"]), **overrides)
    print(json.dumps(c, sort_keys=True))


def rows(x):
    return None if x is None else torch.tensor(x, dtype=torch.long)


def cmd_logits(argv):
    p = argparse.ArgumentParser(prog="moe_ref.py logits")
    p.add_argument("dir")
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    model = load_model(a.dir).eval()
    with open(a.tokens) as f:
        obj = json.load(f)
    with torch.no_grad():
        logits, _ = model(rows(obj["tokens"]), rows(obj.get("positions")), rows(obj.get("segments")))
    with open(a.out, "w") as f:
        json.dump({"logits": logits.tolist()}, f)


def cmd_train(argv):
    p = argparse.ArgumentParser(prog="moe_ref.py train")
    p.add_argument("dir")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--micro", type=int, required=True)
    p.add_argument("--eval-rows", type=int, default=0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--min-lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--out", required=True)
    p.add_argument("--out-weights", default="")
    a = p.parse_args(argv)
    model = load_model(a.dir).train()
    tokens = lm_train_tokens(read_tokens(a.data), a.val_fraction, a.block_size, a.eval_rows or a.micro)
    sampler = WindowSampler(tokens, a.block_size, a.global_batch, a.seed)

    def step_batches(s):
        x, y = sampler.global_batch(s)
        return _split({"input": x, "target": y, "position": None, "segment": None}, a.micro)

    records = train(model, step_batches, a)
    with open(a.out, "w") as f:
        json.dump({"steps": records, "losses": [r["loss"] for r in records]}, f)
    if a.out_weights:
        write_safetensors(a.out_weights, {n: p.detach().float() for n, p in model.state_tensors().items()},
                          {"format": "pt"})


def main():
    torch.set_num_threads(1)
    cmds = {"make": cmd_make, "logits": cmd_logits, "train": cmd_train}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        sys.exit(__doc__)
    cmds[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
