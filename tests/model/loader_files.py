"""Tiny model files for the loader tests: random transformers models (saved as HF safetensors
directories, or their state dicts) and GGUF files written from them the way llama.cpp's
convert_hf_to_gguf.py does."""
from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import quantize

T = gguf.GGMLQuantizationType


def _tiny_hf_model(kind: str, tied: bool, kv_heads: int, inter: int = 128):
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=inter, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  tie_word_embeddings=tied, rope_theta=12345.0)
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[kind]
    torch.manual_seed(0)
    model = getattr(tf, prefix + "ForCausalLM")(getattr(tf, prefix + "Config")(**common))
    with torch.no_grad():  # norms start at 1: make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    return model


DIMS = dict(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2)


def _hf_state(bias: bool, tied: bool, inter: int = 128) -> dict[str, np.ndarray]:
    """A tiny random transformers model's state_dict (Qwen2 for q/k/v bias), as numpy."""
    model = _tiny_hf_model("qwen2" if bias else "llama", tied, DIMS["kv_heads"], inter)
    return {k: v.numpy() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf: str) -> str:
    stem, suffix = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, i, mod = stem.split(".", 3)
        return f"blk.{i}.{_TO_GGUF[mod]}.{suffix}"
    return f"{_TO_GGUF[stem]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (n_head already the projection's head count)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, state, qtype=T.F32, arch="llama", name="tiny", extra=()):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", name)
    meta = {"block_count": DIMS["layers"], "context_length": 512, "embedding_length": DIMS["hidden"],
            "feed_forward_length": state["model.layers.0.mlp.up_proj.weight"].shape[0],
            "attention.head_count": DIMS["heads"], "attention.head_count_kv": DIMS["kv_heads"],
            "vocab_size": DIMS["vocab"]}
    for key, value in meta.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 50000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    for key, value in (("bos", 1), ("eos", 2), ("eot", 5)):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    for hf, x in state.items():
        if arch == "llama" and ".q_proj." in hf:
            x = _llama_cpp_permute(x, DIMS["heads"])
        elif arch == "llama" and ".k_proj." in hf:
            x = _llama_cpp_permute(x, DIMS["kv_heads"])
        if x.ndim == 1 or qtype == T.F32:
            w.add_tensor(_gguf_name(hf), x)
        elif qtype == T.F16:
            w.add_tensor(_gguf_name(hf), x.astype(np.float16))
        else:
            w.add_tensor(_gguf_name(hf), quantize(x, qtype), raw_dtype=qtype)
    for gname, data, raw_dtype in extra:
        w.add_tensor(gname, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
