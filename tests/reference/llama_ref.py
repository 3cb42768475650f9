#!/usr/bin/python3
"""An independent PyTorch reference of the Llama family (Llama 2/3, Mistral,
Qwen2) as Hugging Face's LlamaForCausalLM computes it, for checking
shardtrain's C++ decoder, its Hugging Face loader, its trainer and its
KV-cached generator. Written from the architecture's definition with only
torch (Debian's python3-torch 1.13) and the standard library: no
transformers, no safetensors package.

Run it with the system Python: /usr/bin/python3 tests/reference/llama_ref.py ...

    make DIR [--key value ...]        write a random tiny HF directory
    make-adapter DIR OUT_DIR --r R --alpha A [--targets q_proj,...] [--seed S] [--b-scale X]
                                      write a random LoRA adapter (PEFT layout) for DIR's model
    logits DIR --tokens IN.json --out OUT.json [--adapter ADIR]
    generate DIR --tokens IN.json --max-new N [--out OUT.json] [--adapter ADIR]
    train DIR --steps N (--batches B.json | --data FILE) [...] --out OUT.json
          [--adapter ADIR [--out-adapter ODIR]]   (LoRA: only A and B train)

See `llama_ref.py CMD --help` and the JSON formats documented at each
command below.
"""
import argparse
import json
import math
import os
import re
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100

# ---- safetensors -------------------------------------------------------------------------

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors(path):
    """{name: tensor} (stored dtype, own memory) and the __metadata__ dict."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    base = 8 + n
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    buf = bytearray(data)  # writable: torch.frombuffer warns on read-only buffers
    for name, e in header.items():
        dtype = _ST_DTYPES[e["dtype"]]
        begin, end = e["data_offsets"]
        shape = list(e["shape"])
        count = 1
        for s in shape:
            count *= s
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        t = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + begin)
        assert t.numel() * t.element_size() == end - begin, f"{path}: {name} size mismatch"
        out[name] = t.reshape(shape).clone()
    return out, meta


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} (names sorted, data 8-byte aligned header as transformers)."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def load_hf_dir(path):
    """(config dict, {name: tensor in stored dtype}) of a HF directory:
    config.json plus model.safetensors or the shards of
    model.safetensors.index.json. `path` may also be a single .safetensors
    file (config then {})."""
    if os.path.isfile(path):
        return {}, read_safetensors(path)[0]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    tensors = {}
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for shard in sorted(set(weight_map.values())):
            got, _ = read_safetensors(os.path.join(path, shard))
            for name, t in got.items():
                if weight_map.get(name) == shard:
                    tensors[name] = t
        missing = sorted(set(weight_map) - set(tensors))
        assert not missing, f"{path}: index names tensors absent from their shards: {missing[:5]}"
    else:
        tensors, _ = read_safetensors(single)
    return config, tensors


# ---- config ------------------------------------------------------------------------------

class Cfg:
    """The fields of a HF config.json the maths needs, defaults resolved."""

    def __init__(self, c):
        self.raw = dict(c)
        self.model_type = c.get("model_type", "llama")
        self.vocab_size = c["vocab_size"]
        self.hidden_size = c["hidden_size"]
        self.intermediate_size = c["intermediate_size"]
        self.num_layers = c["num_hidden_layers"]
        self.num_heads = c["num_attention_heads"]
        self.num_kv_heads = c.get("num_key_value_heads") or self.num_heads
        self.head_dim = c.get("head_dim") or self.hidden_size // self.num_heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.tie = bool(c.get("tie_word_embeddings", False))
        # Bias: qwen2 always has q/k/v biases (no o_proj bias); llama and
        # mistral's `attention_bias` puts a bias on q, k, v AND o_proj.
        if self.model_type == "qwen2":
            self.qkv_bias, self.o_bias = True, False
        else:
            ab = bool(c.get("attention_bias", False))
            self.qkv_bias, self.o_bias = ab, ab
        self.mlp_bias = bool(c.get("mlp_bias", False))
        rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
        self.rope_theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
        self.rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type {self.rope_type!r} is not supported by this reference")
        self.rope = rp
        self.max_positions = c.get("max_position_embeddings", 2048)
        # Sliding-window attention (Mistral; Qwen2 with use_sliding_window)
        # is not modelled: sequences longer than the window are refused.
        sw = c.get("sliding_window")
        self.sliding_window = sw if (self.model_type == "mistral" or c.get("use_sliding_window")) else None


def inverse_frequencies(cfg):
    """[head_dim/2] fp32 inverse frequencies, Llama-3 scaling applied."""
    d = cfg.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    inv = 1.0 / (cfg.rope_theta ** exponents)
    if cfg.rope_type != "llama3":
        return inv
    factor = float(cfg.rope["factor"])
    low = float(cfg.rope["low_freq_factor"])
    high = float(cfg.rope["high_freq_factor"])
    context = float(cfg.rope["original_max_position_embeddings"])
    out = []
    # Element by element, from the definition: long wavelengths (beyond
    # context/low) are slowed by `factor`, short ones (below context/high)
    # kept, and in between interpolated by how many wavelengths fit the
    # original context.
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < context / high:
            out.append(f)
        elif wavelen > context / low:
            out.append(f / factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float32)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(inv, position):
    """cos, sin [B, T, d] (fp32) for integer positions [B, T]."""
    angles = position.float()[..., None] * inv[None, None, :]  # [B, T, d/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x [B, H, T, d]; cos/sin [B, T, d]."""
    cos = cos[:, None].to(x.dtype)
    sin = sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


# ---- model -------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, self.nh * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * d, h, bias=cfg.o_bias)

    def forward(self, x, cos, sin, mask, cache=None):
        """mask [B, T, S] bool (True: may attend); cache: dict with 'k','v'
        [B, nkv, S0, d] to prepend to (updated in place)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            if "k" in cache:
                k = torch.cat((cache["k"], k), dim=2)
                v = torch.cat((cache["v"], v), dim=2)
            cache["k"], cache["v"] = k, v
        rep = self.nh // self.nkv  # query head i reads kv head i // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d)
        scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
        p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        y = torch.matmul(p, v).transpose(1, 2).reshape(b, t, self.nh * self.d)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)


def segment_positions(segment):
    """Positions restarting at 0 wherever the segment id changes along T."""
    b, t = segment.shape
    pos = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        start = 0
        for i in range(t):
            if i > 0 and segment[r, i] != segment[r, i - 1]:
                start = i
            pos[r, i] = i - start
    return pos


class LlamaRef(nn.Module):
    """LlamaForCausalLM with Hugging Face's parameter names."""

    def __init__(self, config):
        super().__init__()
        self.cfg = config if isinstance(config, Cfg) else Cfg(config)
        self.model = Decoder(self.cfg)
        if not self.cfg.tie:
            self.lm_head = nn.Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(self.cfg), persistent=False)

    def head(self, x):
        if self.cfg.tie:
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)  # a module call: "lm_head" may be a LoRA target

    def forward(self, idx, position=None, segment=None, cache=None):
        """idx [B, T] -> logits [B, T, V] (fp32 when the weights are).

        position [B, T]: rotary positions (default 0..T-1, or restarting per
        segment when `segment` is given). segment [B, T]: packed rows;
        attention is causal and only between equal segment ids.
        cache: list of dicts (one per layer, start as [{}...]) for
        incremental decoding; keys are then appended, the mask is causal
        over the whole cached prefix, and `position` defaults to the
        continuation of the cached length."""
        b, t = idx.shape
        past = cache[0]["k"].shape[2] if cache is not None and "k" in cache[0] else 0
        if position is None:
            if segment is not None:
                position = segment_positions(segment)
            else:
                position = torch.arange(past, past + t).expand(b, t)
        cos, sin = rope_cos_sin(self.inv_freq, position)
        s = past + t
        if self.cfg.sliding_window and s > self.cfg.sliding_window:
            raise NotImplementedError(f"{s} positions exceed sliding_window {self.cfg.sliding_window}")
        qi = torch.arange(past, s)[:, None]
        ki = torch.arange(s)[None, :]
        mask = (ki <= qi)[None].expand(b, t, s)
        if segment is not None:
            assert past == 0, "segments with a cache are not supported"
            mask = mask & (segment[:, :, None] == segment[:, None, :])
        x = self.model.embed_tokens(idx)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, None if cache is None else cache[i])
        return self.head(self.model.norm(x))

    def state_tensors(self):
        """{HF name: tensor} of the parameters (lm_head absent when tied)."""
        return {n: p for n, p in self.named_parameters()}

    @torch.no_grad()
    def generate(self, idx, max_new):
        """Greedy continuation (temperature 0) with a KV cache; ties go to
        the lowest id (argmax's first maximum). Returns [B, max_new]."""
        cache = [{} for _ in self.model.layers]
        logits = self.forward(idx, cache=cache)
        out = []
        for _ in range(max_new):
            nxt = logits[:, -1].float().argmax(-1, keepdim=True)
            out.append(nxt)
            logits = self.forward(nxt, cache=cache)
        return torch.cat(out, dim=1) if out else idx[:, :0]

    @torch.no_grad()
    def generate_uncached(self, idx, max_new):
        """The same greedy continuation recomputing the whole prefix each token."""
        seq = idx
        for _ in range(max_new):
            nxt = self.forward(seq)[:, -1].float().argmax(-1, keepdim=True)
            seq = torch.cat((seq, nxt), dim=1)
        return seq[:, idx.shape[1]:]


def load_model(path, dtype=torch.float32):
    """LlamaRef with the weights of a HF directory, in `dtype` (default fp32;
    None keeps the stored dtype of the embedding). Every tensor must match."""
    config, tensors = load_hf_dir(path)
    model = LlamaRef(config)
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    assert not missing and not unexpected, f"{path}: missing {missing}, unexpected {unexpected}"
    with torch.no_grad():
        for n, p in own.items():
            assert tuple(tensors[n].shape) == tuple(p.shape), f"{n}: {tensors[n].shape} vs {p.shape}"
            p.copy_(tensors[n].float())
    if dtype is None:
        dtype = tensors["model.embed_tokens.weight"].dtype
    return model.to(dtype)


# ---- LoRA (Hugging Face PEFT layout) ------------------------------------------------------
#
# From the LoRA paper (Hu et al. 2021) with PEFT's conventions: an adapted
# Linear computes  y = x W^T + b + scale * (x A^T) B^T,  A [r, in], B [out, r],
# scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora); W and b stay
# frozen, only A and B train. An adapter directory holds
#
#   adapter_config.json   {"peft_type": "LORA", "r": R, "lora_alpha": A,
#                          "target_modules": ["q_proj", ...], "lora_dropout": 0.0,
#                          "fan_in_fan_out": false, "bias": "none",
#                          "base_model_name_or_path": "", "task_type": "CAUSAL_LM"}
#                         (optional: "use_rslora": bool; other PEFT keys ignored)
#   adapter_model.safetensors
#                         F32 tensors "base_model.model.<module>.lora_A.weight"
#                         [r, in_features] and "...lora_B.weight" [out_features, r]
#                         for every adapted module, e.g.
#                         base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight;
#                         with "bias": "all", also every bias of the model
#                         ("base_model.model.<module>.bias"), replacing the base's
#
# A module is adapted when its name equals a target or ends with "." + target
# (PEFT's rule for a list; a string target_modules is a full-match regex).

PEFT_PREFIX = "base_model.model."
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraLinear(nn.Module):
    """An nn.Linear with a LoRA branch. It keeps the base's own `weight` and
    `bias` Parameters under the same names, so the module's parameters are
    <name>.weight, <name>.bias (if any), <name>.lora_A.weight, <name>.lora_B.weight."""

    def __init__(self, base, r, scale):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=dev, dtype=dt)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=dev, dtype=dt)
        self.r, self.scale = r, scale

    def forward(self, x):
        # dropout 0: the branch sees x itself
        delta = F.linear(F.linear(x, self.lora_A.weight), self.lora_B.weight)
        return F.linear(x, self.weight, self.bias) + delta * self.scale

    def merged_weight(self):
        """W + scale * B A in fp32 (then the base dtype)."""
        w = self.weight.detach().float()
        ba = self.lora_B.weight.detach().float() @ self.lora_A.weight.detach().float()
        return (w + self.scale * ba).to(self.weight.dtype)


def lora_scale(config):
    """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r


def _is_target(name, targets):
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_targets(model, targets):
    """[(module name, nn.Linear)] of the model's modules that `targets`
    selects, in model order. ValueError when one is not an nn.Linear or
    nothing matches."""
    out = []
    for name, mod in model.named_modules():
        if not name or not _is_target(name, targets):
            continue
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"LoRA target {name!r} is a {type(mod).__name__}, not a Linear layer")
        out.append((name, mod))
    if not out:
        raise ValueError(f"LoRA target_modules {targets!r} match no module of the model")
    return out


def check_lora_config(config, where=""):
    """ValueError for an adapter_config.json this reference does not model."""
    where = f"{where}: " if where else ""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}peft_type {config.get('peft_type')!r} is not LORA")
    for k in ("r", "lora_alpha", "target_modules"):
        if k not in config:
            raise ValueError(f"{where}adapter config has no {k!r}")
    if int(config["r"]) <= 0:
        raise ValueError(f"{where}r must be > 0, got {config['r']}")
    if config.get("fan_in_fan_out", False):
        raise ValueError(f"{where}fan_in_fan_out true is for Conv1D (GPT-2) layers, not Llama's Linear")
    if config.get("bias", "none") not in ("none", "all"):
        raise ValueError(f"{where}bias {config.get('bias')!r}: only 'none' and 'all' are modelled")
    for k in ("use_dora", "rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if config.get(k):
            raise ValueError(f"{where}{k} {config[k]!r} is not modelled by this reference")


def apply_lora(model, config):
    """Freezes every parameter of `model`, then replaces each targeted
    nn.Linear by a LoraLinear (A, B zero-initialised, trainable). Returns the
    adapted module names in model order."""
    check_lora_config(config)
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise ValueError("the model already has a LoRA adapter")
    r, scale = int(config["r"]), lora_scale(config)
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for name, lin in lora_targets(model, config["target_modules"]):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapped = LoraLinear(lin, r, scale)
        with torch.no_grad():
            wrapped.lora_A.weight.zero_()
            wrapped.lora_B.weight.zero_()
        setattr(parent, child, wrapped)
        names.append(name)
    return names


def lora_tensors(model):
    """{PEFT name: fp32 tensor} of the adapter of a model apply_lora adapted."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLinear):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = mod.lora_A.weight.detach().float()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = mod.lora_B.weight.detach().float()
    return out


def merged_state(model):
    """{HF name: tensor} with every LoraLinear folded in (W + scale B A) and
    the lora tensors left out: what the base model with the adapter merged
    holds."""
    out = {}
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        mod = model.get_submodule(name.rpartition(".")[0])
        out[name] = mod.merged_weight() if isinstance(mod, LoraLinear) and name.endswith(".weight") else p.detach()
    return out


def read_adapter(path):
    """(adapter_config dict, {name: tensor}) of a PEFT adapter directory."""
    config = _read_json(os.path.join(path, PEFT_CONFIG))
    check_lora_config(config, os.path.join(path, PEFT_CONFIG))
    tensors, _ = read_safetensors(os.path.join(path, PEFT_WEIGHTS))
    return config, tensors


def load_adapter(model, path):
    """Adapts `model` (apply_lora) with the adapter directory `path` and
    copies its A and B in. ValueError naming every missing tensor (of a
    targeted module), unexpected tensor or shape mismatch. Returns the
    adapter's config."""
    config, tensors = read_adapter(path)
    apply_lora(model, config)
    own = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLinear):
            own[f"{PEFT_PREFIX}{name}.lora_A.weight"] = mod.lora_A.weight
            own[f"{PEFT_PREFIX}{name}.lora_B.weight"] = mod.lora_B.weight
    if config.get("bias", "none") == "all":
        # PEFT's bias "all": every bias of the model trained, and the file
        # holds each one under its PEFT name, replacing the base's.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                own[f"{PEFT_PREFIX}{name}"] = p
    missing = [n for n in own if n not in tensors]
    unexpected = sorted(n for n in tensors if n not in own)
    mismatched = [f"{n} (file {list(tensors[n].shape)}, model {list(p.shape)})"
                  for n, p in own.items() if n in tensors and tensors[n].shape != p.shape]
    if missing or unexpected or mismatched:
        parts = [f"the adapter in {path!r} does not fit the model"]
        if missing:
            parts.append(f"missing from the file: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected (no such targeted module): {', '.join(unexpected)}")
        if mismatched:
            parts.append(f"shapes differ: {', '.join(mismatched)}")
        raise ValueError("; ".join(parts))
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(tensors[n].to(p.dtype))
    return config


def write_adapter(path, model, config):
    """Writes `path`/adapter_model.safetensors (F32, PEFT names) and
    `path`/adapter_config.json (`config` as given) for an adapted model."""
    os.makedirs(path, exist_ok=True)
    tensors = lora_tensors(model)
    if not tensors:
        raise ValueError("the model has no LoRA adapter to write")
    write_safetensors(os.path.join(path, PEFT_WEIGHTS), tensors, {"format": "pt", "producer": "llama_ref.py"})
    with open(os.path.join(path, PEFT_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def adapter_config(r, alpha, targets):
    """The adapter_config.json make-adapter writes."""
    return {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
            "lora_dropout": 0.0, "fan_in_fan_out": False, "bias": "none",
            "base_model_name_or_path": "", "task_type": "CAUSAL_LM"}


def make_adapter(model_dir, out_dir, r, alpha, targets=None, seed=0, b_scale=0.02):
    """Writes a random adapter for the model in `model_dir` and returns its
    config: for each adapted module in model order, A = normal(0, 1) * 0.02
    then B = normal(0, 1) * b_scale, both drawn from one
    torch.Generator().manual_seed(seed). B is not zero (unless b_scale is 0),
    so the adapter changes the model's output."""
    with open(os.path.join(model_dir, "config.json")) as f:
        model = LlamaRef(json.load(f))
    config = adapter_config(r, alpha, LORA_TARGETS if targets is None else targets)
    apply_lora(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, mod in model.named_modules():
            if isinstance(mod, LoraLinear):
                mod.lora_A.weight.copy_(0.02 * torch.randn(mod.lora_A.weight.shape, generator=gen))
                mod.lora_B.weight.copy_(b_scale * torch.randn(mod.lora_B.weight.shape, generator=gen))
    write_adapter(out_dir, model, config)
    return config


# ---- tiny directories --------------------------------------------------------------------

TINY_DEFAULTS = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "attention_bias": False, "max_position_embeddings": 128,
}
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def make_tiny(path, shards=1, dtype="F32", seed=0, **overrides):
    """Writes a random tiny HF directory at `path` and returns its config.

    overrides: any config.json keys (`head_dim`, `rope_scaling`, ...). Weights:
    normal(0, 0.02), biases normal(0, 0.02), norm weights 1 + normal(0, 0.1).
    shards > 1: the tensors (sorted by name, model.embed_tokens first in
    transformers' order of the state dict) split into N files of about equal
    size, model-0000k-of-0000N.safetensors, and model.safetensors.index.json."""
    c = dict(TINY_DEFAULTS)
    c.update(overrides)
    mt = c["model_type"]
    c.setdefault("architectures", [_ARCH.get(mt, "LlamaForCausalLM")])
    c["torch_dtype"] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[dtype]
    if mt == "qwen2":
        c.pop("attention_bias", None)
    if mt == "mistral":
        c.setdefault("sliding_window", None)
    c.setdefault("hidden_act", "silu")
    c.setdefault("initializer_range", 0.02)
    c.setdefault("bos_token_id", 1)
    c.setdefault("eos_token_id", 2)
    model = LlamaRef(c)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():  # module order: the HF state-dict order
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            else:
                t = 0.02 * torch.randn(p.shape, generator=gen)
            tensors[name] = t.to(_ST_DTYPES[dtype])
    os.makedirs(path, exist_ok=True)
    for stale in os.listdir(path):
        if stale.endswith(".safetensors") or stale == "model.safetensors.index.json":
            os.remove(os.path.join(path, stale))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")
    meta = {"format": "pt"}
    if shards <= 1:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors, meta)
        return c
    names = list(tensors)  # state-dict order, as transformers shards
    nbytes = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
    total = sum(nbytes.values())
    groups = [[] for _ in range(shards)]
    acc, k = 0, 0
    for n in names:
        # Move on once this shard holds its share (leaving enough names for the rest).
        while k < shards - 1 and acc >= total * (k + 1) / shards and groups[k]:
            k += 1
        groups[k].append(n)
        acc += nbytes[n]
    groups = [g for g in groups if g]
    n_files = len(groups)
    weight_map = {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        write_safetensors(os.path.join(path, fname), {n: tensors[n] for n in g}, meta)
        for n in g:
            weight_map[n] = fname
    index = {"metadata": {"total_size": total},
             "weight_map": {n: weight_map[n] for n in sorted(weight_map)}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return c


# ---- the trainer's data order ------------------------------------------------------------

_M64 = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64 (its output sequence is fixed by the C++ standard)."""

    def __init__(self, seed):
        self.mt = [0] * 312
        self.mt[0] = seed & _M64
        for i in range(1, 312):
            prev = self.mt[i - 1]
            self.mt[i] = (6364136223846793005 * (prev ^ (prev >> 62)) + i) & _M64
        self.i = 312

    def _twist(self):
        mt = self.mt
        for i in range(312):
            x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % 312] & 0x7FFFFFFF)
            xa = x >> 1
            if x & 1:
                xa ^= 0xB5026F5AA96619E9
            mt[i] = mt[(i + 156) % 312] ^ xa
        self.i = 0

    def __call__(self):
        if self.i >= 312:
            self._twist()
        y = self.mt[self.i]
        self.i += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & _M64


def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniform_below(rng, bound):
    threshold = ((1 << 64) - bound) % bound
    while True:
        r = rng()
        if r >= threshold:
            return r % bound


def read_tokens(path):
    """A token file (llm.c layout: 256 int32 header words, magic 20240520,
    version 1, count; then uint16 tokens) or text read as bytes."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) >= 1024 and struct.unpack("<i", raw[:4])[0] == 20240520:
        count = struct.unpack("<i", raw[8:12])[0]
        return torch.frombuffer(bytearray(raw[1024:1024 + 2 * count]), dtype=torch.int16).long() & 0xFFFF
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class WindowSampler:
    """shardtrain::data::WindowSampler: windows of block_size + 1 tokens at
    multiples of block_size; epoch e visited in a Fisher-Yates permutation
    from mt19937_64(mix64(seed ^ mix64(e))), global batch s = windows
    [s*G, (s+1)*G) of the epoch's order (s taken modulo steps per epoch)."""

    def __init__(self, tokens, block_size, global_batch, seed, shuffle=True):
        self.tokens, self.t, self.g = tokens, block_size, global_batch
        self.seed, self.shuffle = seed, shuffle
        self.num_windows = (len(tokens) - 1) // block_size if len(tokens) >= 1 else 0
        assert self.num_windows >= global_batch, "fewer windows than one global batch"
        self._epoch, self._order = -1, None

    def steps_per_epoch(self):
        return self.num_windows // self.g

    def order(self, epoch):
        if not self.shuffle:
            return list(range(self.num_windows))
        if self._epoch != epoch:
            rng = MT19937_64(mix64((self.seed ^ mix64(epoch)) & _M64))
            order = list(range(self.num_windows))
            for w in range(self.num_windows - 1, 0, -1):
                o = uniform_below(rng, w + 1)
                order[w], order[o] = order[o], order[w]
            self._epoch, self._order = epoch, order
        return self._order

    def global_batch(self, step):
        """(input, target) [G, T] of optimizer step `step` (0-based)."""
        epoch = step // self.steps_per_epoch()
        first = (step % self.steps_per_epoch()) * self.g
        order = self.order(epoch)
        rows = [self.tokens[order[first + r] * self.t: order[first + r] * self.t + self.t + 1]
                for r in range(self.g)]
        w = torch.stack(rows)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def lm_train_tokens(tokens, val_fraction, block_size, eval_rows):
    """The training part of the data as train/task.cpp's lm_task splits it:
    n_val = max(int(size * val_fraction), eval_rows * block_size + 1) held
    out at the end when val_fraction > 0 (eval_rows = micro * world)."""
    if val_fraction <= 0:
        return tokens
    n_val = max(int(len(tokens) * val_fraction), eval_rows * block_size + 1)
    return tokens[:len(tokens) - n_val]


# ---- the trainer's optimizer semantics ---------------------------------------------------

def scheduled_lr(step, lr, min_lr, warmup, max_steps, schedule="cosine"):
    """src/train/schedule.cpp: step is 0-based."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    decay_steps = max(1, max_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_grad_norm(params, max_norm):
    """src/strategy/common.cpp clip_grad_norm: per-gradient 2-norms in their
    dtype, squares summed in double; scaled by max/(total+1e-6) when < 1.
    Returns the pre-clip total norm."""
    grads = [p.grad for p in params if p.grad is not None]
    total = math.sqrt(sum(float(g.norm(2)) ** 2 for g in grads))
    if max_norm > 0:
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total


def _rows(x):
    return None if x is None else torch.tensor(x, dtype=torch.long)


def _batch_from_json(obj):
    if "tokens" in obj:
        w = torch.tensor(obj["tokens"], dtype=torch.long)
        return {"input": w[:, :-1], "target": w[:, 1:], "position": None, "segment": None}
    return {"input": _rows(obj["input"]), "target": _rows(obj["target"]),
            "position": _rows(obj.get("position", obj.get("positions"))),
            "segment": _rows(obj.get("segment", obj.get("segments")))}


def _split(batch, micro):
    n = batch["input"].shape[0]
    if micro <= 0 or micro >= n:
        return [batch]
    assert n % micro == 0, f"global batch {n} is not a multiple of micro {micro}"
    return [{k: (None if v is None else v[i:i + micro]) for k, v in batch.items()}
            for i in range(0, n, micro)]


def train(model, step_batches, a):
    """The Trainer::fit loop at world size 1: for each step, micro-batches
    [{input, target, position?, segment?}]; returns per-step records."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": a.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    records = []
    for step in range(a.steps):
        micro_batches = step_batches(step)
        total = sum(int((b["target"] != IGNORE_INDEX).sum()) for b in micro_batches)
        assert total > 0, f"step {step + 1} has no targets"
        loss_sum = 0.0
        for b in micro_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=getattr(a, "autocast", "") == "bf16"):
                logits = model(b["input"], b["position"], b["segment"])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b["target"].reshape(-1),
                                   reduction="sum", ignore_index=IGNORE_INDEX)
            (loss * (1.0 / total)).backward()
            loss_sum += float(loss)
        norm = clip_grad_norm(params, a.max_grad_norm)
        lr = scheduled_lr(step, a.lr, a.min_lr, a.warmup, a.max_steps or a.steps, a.schedule)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=False)
        records.append({"step": step + 1, "loss": loss_sum / total, "lr": lr, "grad_norm": norm,
                        "targets": total})
    return records


# ---- CLI ---------------------------------------------------------------------------------

def _parse_value(s):
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _write_json(path, obj):
    text = json.dumps(obj)
    if path in ("", "-"):
        print(text)
        return
    with open(path, "w") as f:
        f.write(text + "\n")


def cmd_make(argv):
    if not argv or argv[0].startswith("--"):
        sys.exit("usage: llama_ref.py make DIR [--shards N] [--dtype F32|BF16|F16] [--seed S] [--KEY JSON ...]")
    path, rest = argv[0], argv[1:]
    opts = {"shards": 1, "dtype": "F32", "seed": 0}
    overrides = {}
    i = 0
    while i < len(rest):
        key = rest[i]
        if not key.startswith("--"):
            sys.exit(f"llama_ref.py make: expected --key, got {key!r}")
        key = key[2:]
        if "=" in key:
            key, val = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(rest):
                sys.exit(f"llama_ref.py make: --{key} needs a value")
            val = rest[i + 1]
            i += 2
        key = key.replace("-", "_") if key in ("shards", "dtype", "seed") else key
        if key in opts:
            opts[key] = val if key == "dtype" else int(val)
        else:
            overrides[key] = _parse_value(val)
    c = make_tiny(path, shards=opts["shards"], dtype=opts["dtype"], seed=opts["seed"], **overrides)
    print(json.dumps(c, sort_keys=True))


def _dtype(name):
    return {"float32": torch.float32, "f32": torch.float32, "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16, "stored": None}[name.lower()]


def _token_input(path):
    obj = _read_json(path)
    if isinstance(obj, list):
        obj = {"tokens": obj}
    idx = torch.tensor(obj["tokens"], dtype=torch.long)
    if idx.dim() == 1:
        idx = idx[None]
    return (idx, _rows(obj.get("positions", obj.get("position"))),
            _rows(obj.get("segments", obj.get("segment"))))


def _load(a):
    """The model of a.dir in a.dtype, with the LoRA adapter a.adapter (if given)."""
    model = load_model(a.dir, _dtype(a.dtype))
    if getattr(a, "adapter", ""):
        try:
            load_adapter(model, a.adapter)
        except ValueError as e:
            sys.exit(f"llama_ref.py: {e}")
    return model


def cmd_make_adapter(argv):
    """Writes OUT_DIR/adapter_model.safetensors and OUT_DIR/adapter_config.json
    (the PEFT layout described at apply_lora's section) for the model of the
    HF directory DIR; prints the adapter config."""
    p = argparse.ArgumentParser(prog="llama_ref.py make-adapter",
                                description="A random LoRA adapter (PEFT layout, F32) for DIR's model.")
    p.add_argument("dir", help="HF directory (only its config.json is read)")
    p.add_argument("out_dir")
    p.add_argument("--r", type=int, required=True)
    p.add_argument("--alpha", type=_parse_value, required=True, help="lora_alpha (number)")
    p.add_argument("--targets", default=",".join(LORA_TARGETS),
                   help="comma-separated target_modules (a module is adapted when its name ends with one)")
    p.add_argument("--seed", type=int, default=0, help="torch.Generator seed of A and B")
    p.add_argument("--b-scale", type=float, default=0.02, help="B = normal * b-scale (0: an identity adapter)")
    a = p.parse_args(argv)
    if not isinstance(a.alpha, (int, float)) or isinstance(a.alpha, bool):
        sys.exit(f"llama_ref.py make-adapter: --alpha must be a number, got {a.alpha!r}")
    targets = [t for t in a.targets.split(",") if t]
    try:
        config = make_adapter(a.dir, a.out_dir, a.r, a.alpha, targets, a.seed, a.b_scale)
    except ValueError as e:
        sys.exit(f"llama_ref.py make-adapter: {e}")
    print(json.dumps(config, sort_keys=True))


def cmd_logits(argv):
    p = argparse.ArgumentParser(prog="llama_ref.py logits")
    p.add_argument("dir")
    p.add_argument("--tokens", required=True, help="JSON: {tokens:[[..]], positions?, segments?} or [[..]]")
    p.add_argument("--out", default="-", help="JSON output ('-': stdout)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | stored")
    p.add_argument("--adapter", default="", help="PEFT LoRA adapter directory applied to the model")
    a = p.parse_args(argv)
    model = _load(a).eval()
    idx, pos, seg = _token_input(a.tokens)
    with torch.no_grad():
        logits = model(idx, pos, seg).float()
    _write_json(a.out, {"shape": list(logits.shape), "logits": logits.tolist()})


def cmd_generate(argv):
    p = argparse.ArgumentParser(prog="llama_ref.py generate")
    p.add_argument("dir")
    p.add_argument("--tokens", required=True, help="JSON prompt: {tokens:[[..]]}, [[..]] or [..]")
    p.add_argument("--max-new", type=int, required=True)
    p.add_argument("--out", default="-")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--adapter", default="", help="PEFT LoRA adapter directory applied to the model")
    a = p.parse_args(argv)
    model = _load(a).eval()
    idx, _, _ = _token_input(a.tokens)
    new = model.generate(idx, a.max_new)
    with torch.no_grad():
        full = torch.cat((idx, new), dim=1)
        step_logits = model(full)[:, idx.shape[1] - 1:-1].float() if a.max_new else None
    # margin: top-1 minus top-2 logit at each greedy choice (a tiny margin
    # means fp rounding may legitimately pick the other token).
    margins = []
    if step_logits is not None:
        top2 = step_logits.topk(2, dim=-1).values
        margins = (top2[..., 0] - top2[..., 1]).tolist()
    _write_json(a.out, {"prompt": idx.tolist(), "new_tokens": new.tolist(),
                        "tokens": torch.cat((idx, new), 1).tolist(), "margins": margins})


def cmd_train(argv):
    p = argparse.ArgumentParser(prog="llama_ref.py train")
    p.add_argument("dir", help="HF directory with the initial weights")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batches", default="", help="JSON of the steps' batches (see the report)")
    p.add_argument("--data", default="", help="token file or text: the trainer's WindowSampler order")
    p.add_argument("--block-size", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=0)
    p.add_argument("--seed", type=int, default=1337, help="run.seed (data order)")
    p.add_argument("--no-shuffle", action="store_true", help="data.shuffle=false")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--eval-rows", type=int, default=0, help="micro * world of the C++ run (val split); default --micro")
    p.add_argument("--micro", type=int, default=0, help="rows per micro-batch (0: whole step at once)")
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
    p.add_argument("--autocast", default="", choices=["", "bf16"],
                   help="bf16: forward under torch.autocast('cpu', bfloat16), fp32 weights and loss")
    p.add_argument("--adapter", default="",
                   help="PEFT LoRA adapter directory: the base is frozen, only its lora_A/lora_B train "
                        "(AdamW weight decay on them, as on every matrix)")
    p.add_argument("--out-adapter", default="", help="with --adapter: the trained adapter, same PEFT layout")
    p.add_argument("--out", default="-",
                   help="JSON {steps: [{step, loss, lr, grad_norm, targets}], losses: [..], "
                        "tensors?: {name: {shape, data}}, lora?: {scale, modules, trainable}}")
    p.add_argument("--out-weights", default="",
                   help="final parameters as one F32 safetensors file (with --adapter: merged, W + scale B A)")
    p.add_argument("--dump", default="", help="comma-separated parameter names to put in --out "
                                               "(lora tensors: <module>.lora_A.weight, PEFT prefix optional)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_model(a.dir, torch.float32).train()
    if bool(a.batches) == bool(a.data):
        sys.exit("llama_ref.py train: give exactly one of --batches and --data")
    if a.out_adapter and not a.adapter:
        sys.exit("llama_ref.py train: --out-adapter needs --adapter (the adapter to start from)")
    lora = None
    if a.adapter:
        try:
            lora = load_adapter(model, a.adapter)
        except ValueError as e:
            sys.exit(f"llama_ref.py train: {e}")
        if float(lora.get("lora_dropout", 0.0) or 0.0) != 0.0:
            sys.exit(f"llama_ref.py train: {a.adapter}: lora_dropout {lora['lora_dropout']} is not modelled "
                     "(its random mask cannot match another implementation); use 0")
    if a.batches:
        steps = _read_json(a.batches)
        steps = steps["steps"] if isinstance(steps, dict) else steps
        assert len(steps) >= a.steps, f"{a.batches} has {len(steps)} steps, fewer than --steps {a.steps}"

        def step_batches(s):
            st = steps[s]
            if isinstance(st, list):
                return [_batch_from_json(m) for m in st]
            return _split(_batch_from_json(st), a.micro)
    else:
        if a.block_size <= 0 or a.global_batch <= 0:
            sys.exit("llama_ref.py train: --data needs --block-size and --global-batch")
        tokens = lm_train_tokens(read_tokens(a.data), a.val_fraction, a.block_size,
                                 a.eval_rows or a.micro or a.global_batch)
        sampler = WindowSampler(tokens, a.block_size, a.global_batch, a.seed, not a.no_shuffle)

        def step_batches(s):
            x, y = sampler.global_batch(s)
            return _split({"input": x, "target": y, "position": None, "segment": None}, a.micro)
    records = train(model, step_batches, a)
    out = {"steps": records, "losses": [r["loss"] for r in records]}
    if lora is not None:
        out["lora"] = {"scale": lora_scale(lora),
                       "modules": [n for n, m in model.named_modules() if isinstance(m, LoraLinear)],
                       "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if a.dump:
        named = dict(model.named_parameters())
        out["tensors"] = {}
        for n in filter(None, a.dump.split(",")):
            key = n[len(PEFT_PREFIX):] if n.startswith(PEFT_PREFIX) and n not in named else n
            if key not in named:
                sys.exit(f"llama_ref.py train: --dump {n!r} is not a parameter of the model")
            out["tensors"][n] = {"shape": list(named[key].shape), "data": named[key].detach().reshape(-1).tolist()}
    if a.out_weights:
        state = merged_state(model) if lora is not None else dict(model.named_parameters())
        write_safetensors(a.out_weights, {n: p.detach().float() for n, p in state.items()},
                          {"format": "pt", "producer": "llama_ref.py"})
    if a.out_adapter:
        write_adapter(a.out_adapter, model, lora)
    _write_json(a.out, out)


def cmd_batches(argv):
    """Writes the WindowSampler's global batches as a --batches JSON."""
    p = argparse.ArgumentParser(prog="llama_ref.py batches")
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--eval-rows", type=int, required=True, help="micro * world of the C++ run")
    p.add_argument("--out", default="-")
    a = p.parse_args(argv)
    tokens = lm_train_tokens(read_tokens(a.data), a.val_fraction, a.block_size, a.eval_rows)
    sampler = WindowSampler(tokens, a.block_size, a.global_batch, a.seed, not a.no_shuffle)
    steps = []
    for s in range(a.steps):
        x, y = sampler.global_batch(s)
        steps.append({"input": x.tolist(), "target": y.tolist()})
    _write_json(a.out, {"steps": steps})


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cmds = {"make": cmd_make, "make-adapter": cmd_make_adapter, "logits": cmd_logits,
            "generate": cmd_generate, "train": cmd_train, "batches": cmd_batches}
    if not argv or argv[0] not in cmds:
        sys.exit(__doc__)
    torch.set_num_threads(1) if argv[0] != "train" else None
    cmds[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
