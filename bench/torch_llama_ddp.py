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

Everything but the model is bench/torch_gpt_ddp.py's (its main() runs this
peer: its flags, timing, profile format, teardown and JSON line):
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
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from llama_ref import LlamaRef, RMSNorm  # noqa: E402
import torch_gpt_ddp  # noqa: E402


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


def llama_args(p):
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-kv-head", type=int, default=2, help="key/value heads; 0: n_head")
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=0, help="0: n_embd / n_head")
    p.add_argument("--intermediate-size", type=int, default=1408)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rms-norm-eps", type=float, default=1e-5)
    p.add_argument("--tie", action="store_true", help="tie lm_head to embed_tokens")


def build(a):
    model, config = build_model(a)
    return model, {"model": "llama", "n_kv_head": config["num_key_value_heads"],
                   "head_dim": config["head_dim"], "intermediate_size": a.intermediate_size,
                   "tie_word_embeddings": a.tie}


if __name__ == "__main__":
    torch_gpt_ddp.main("torch_llama_ddp.py", __doc__, llama_args, build,
                       block_size=256, global_batch=8, micro=2, steps=10, warmup=3)
