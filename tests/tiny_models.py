"""Tiny random Hugging Face checkpoints, written with transformers itself, for tests."""
from __future__ import annotations

import os

import torch

TINY = {
    # name: (config class name, extra config)
    "llama-gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4,
                                      tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
}


def make_tiny_model(path: str, kind: str = "llama-gqa", seed: int = 0):
    """Save a random tiny model of `kind` to `path`; returns the transformers model (fp32)."""
    import transformers

    cls_name, extra = TINY[kind]
    cfg_cls = getattr(transformers, cls_name)
    cfg = cfg_cls(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  head_dim=16, max_position_embeddings=1024, rope_theta=10000.0,
                  bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    model = model_cls(cfg).float().eval()
    # larger-than-default weights so attention is not uniform and tokens differ
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, max_shard_size="100KB")
    return model
