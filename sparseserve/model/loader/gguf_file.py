"""GGUF files (llama.cpp's format): architecture from metadata, weights dequantized to torch.

Weights come out under Hugging Face names and in Hugging Face's layout: llama.cpp's converter
permutes the rows of Q and K of "llama" models so that interleaved RoPE (pairs 2i, 2i+1)
computes what rotate-half RoPE (pairs i, i + head_dim/2) computes on the original weights;
`unpermute_rows` undoes that, so the model uses the same rotate-half RoPE for every source.
"""
from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Iterator

import numpy as np
import torch

from sparseserve.config import ModelConfig

from .hf import describe_mismatch, expected_weight_shapes

# GGUF `general.architecture` -> transformers class; llama.cpp converts Mistral models to "llama".
_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Architectures whose converter permutes Q/K rows for interleaved RoPE (qwen2 uses NEOX RoPE).
_PERMUTED_QK = {"llama"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Precomputed llama3 RoPE frequency factors: folded into ModelConfig.rope_scaling, not a weight.
_ROPE_FREQS = "rope_freqs.weight"

_MISSING = object()


def supported_types() -> tuple[str, ...]:
    """Names of the GGML tensor types this loader dequantizes.

    Plain floats, the legacy block quants (which gguf-py can also write, so tests round-trip
    them) and the K-quants that llama.cpp's popular Q4_K_M / Q5_K_M / Q6_K presets produce."""
    return ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, mtime_ns: int, size: int) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path, "r")


def open_gguf(path: str) -> Any:
    """A memory-mapped gguf.GGUFReader for `path` (cached: parsing the tokenizer arrays of a
    real file takes seconds, and resolve, config, weights all read the same file).
    ValueError if the file is not a readable GGUF."""
    st = os.stat(path)
    try:
        return _cached_reader(os.path.abspath(path), st.st_mtime_ns, st.st_size)
    except Exception as exc:  # gguf raises ValueError/struct.error/IndexError on corrupt files
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def field_value(reader: Any, key: str, default: Any = _MISSING) -> Any:
    """Python value of metadata `key` (str, int, float, bool or a list of them)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing; the file is incomplete or not a "
                             "llama.cpp model export.")
        return default

    def one(part: Any, vtype: Any) -> Any:
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part[0].item()

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def gguf_architecture(reader: Any, path: str) -> str:
    """`general.architecture`, checked to be one sparseserve runs."""
    arch = field_value(reader, "general.architecture")
    if arch not in _ARCH_CLASSES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {path}. sparseserve runs Llama-family "
            f"decoders; supported GGUF architectures: {sorted(_ARCH_CLASSES)}.")
    return arch


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover Hugging Face's llama3 rope_scaling from llama.cpp's rope_freqs tensor.

    The converter stores, per rotary frequency, the divisor llama3 scaling applies to it;
    we find the (factor, low/high_freq_factor, original context) that reproduce it."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    factor = float(factors.max())
    for original in (8192, 4096, 16384, 32768, 2048):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            smooth = (original / wavelen - low) / (high - low)
            expect = np.where(wavelen < original / high, 1.0,
                              np.where(wavelen > original / low, factor,
                                       1.0 / ((1.0 - smooth) / factor + smooth)))
            if expect.shape == factors.shape and np.allclose(expect, factors, rtol=1e-4, atol=1e-4):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError("The GGUF file's rope_freqs tensor matches no llama3 RoPE scaling; sparseserve "
                     "cannot reproduce its RoPE. Load the Hugging Face checkpoint instead.")


def _rope_scaling(reader: Any, arch: str, theta: float, head_dim: int, path: str) -> dict | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field_value(reader, f"{arch}.rope.scaling.factor"))}
    if kind not in ("none", ""):
        raise ValueError(f"RoPE scaling type {kind!r} in {path} is not supported (only llama3 and linear).")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is None:
        return None
    return _llama3_rope_scaling(_dequantize(freqs).numpy().astype(np.float64), theta, head_dim)


def gguf_hf_config(reader: Any, path: str) -> dict[str, Any]:
    """A Hugging Face config.json-style dict describing the model in a GGUF file."""
    arch = gguf_architecture(reader, path)
    key = lambda suffix, default=_MISSING: field_value(reader, f"{arch}.{suffix}", default)  # noqa: E731
    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ValueError(f"{path} has per-layer head counts; sparseserve needs the same heads in every layer.")
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", 0) or hidden // heads)
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path} rotates {rope_dim} of {head_dim} head dimensions (partial RoPE); "
                         "sparseserve's Llama-family model rotates the whole head.")
    vocab = key("vocab_size", None)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    names = {t.name for t in reader.tensors}
    if vocab is None:  # neither key: the embedding's row count is the vocabulary
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ValueError(f"{path} has no vocabulary size, tokenizer or token_embd.weight tensor.")
        vocab = int(embd.shape[-1])
    theta = float(key("rope.freq_base", 10000.0))
    # llama.cpp writes every end-of-generation token it knows (eos, end of turn, end of message).
    eos = [field_value(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    model_name = str(field_value(reader, "general.name", ""))
    cls = _ARCH_CLASSES[arch]
    if arch == "llama" and "mistral" in model_name.lower():
        cls = "MistralForCausalLM"  # same weights and math; keeps the name transformers reports
    weight_types = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    dtype = {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(frozenset(weight_types), "float32")
    return {
        "architectures": [cls],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}.get(cls, "qwen2"),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, theta, head_dim, path),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
        # Quantized tensors are dequantized to float32; plain F16/BF16 files keep their dtype.
        "torch_dtype": dtype,
    }


def load_gguf_config(path: str, name: str) -> ModelConfig:
    """ModelConfig from the metadata of the GGUF file at `path` (from the cache when the file
    was read before: gguf_cache.py)."""
    from . import gguf_cache

    hit = gguf_cache.cached(path, gguf_cache.CONFIG)
    if hit is not None:
        with open(hit, encoding="utf-8") as f:
            return ModelConfig.from_hf_dict(json.load(f), name=name)
    hf = gguf_hf_config(open_gguf(path), path)
    gguf_cache.store_config(path, hf)
    return ModelConfig.from_hf_dict(hf, name=name)


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face parameter name of a GGUF tensor name (None if it has none)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        if parts[3] in ("weight", "bias"):
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp convert_hf_to_gguf's `permute(w, n_head, n_head_kv)` (with n_head
    already the head count of this projection): GGUF row 2i+j of a head is HF row j*d/2+i."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _dequantize(tensor: Any) -> torch.Tensor:
    """A GGUF tensor as a CPU torch tensor of its numpy shape (reverse of GGUF's ne order)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    kind = tensor.tensor_type
    if kind in (T.F32, T.F16):
        # np.array copies out of the read-only memory map; torch needs writable memory.
        return torch.from_numpy(np.array(tensor.data)).reshape(shape)
    if kind == T.BF16:
        # numpy has no bfloat16: reinterpret the raw 16-bit words, no float32 detour.
        raw = np.array(tensor.data).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(dequantize(tensor.data, kind)).reshape(shape)


def plan_gguf(reader: Any, path: str, config: ModelConfig) -> list[tuple[Any, str]]:
    """Check every tensor's type, name and shape against `config` without reading weights;
    return (reader tensor, HF name) pairs to load. ValueError names the first problem."""
    supported = set(supported_types())
    for t in reader.tensors:
        if t.tensor_type.name not in supported:
            raise ValueError(
                f"GGUF tensor {t.name!r} in {path} has type {t.tensor_type.name}, which sparseserve "
                f"cannot dequantize. Supported types: {', '.join(supported_types())}. Convert the "
                "file with llama.cpp to one of them, e.g. `llama-quantize --allow-requantize "
                f"{os.path.basename(path)} out.gguf Q8_0`, or export the Hugging Face checkpoint "
                "again with `convert_hf_to_gguf.py --outtype f16` (or bf16, q8_0).")
    expected = expected_weight_shapes(config)
    plan, found, unexpected = [], {}, []
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        name = hf_name(t.name)
        if name is None or name not in expected:
            unexpected.append(t.name)
            continue
        found[name] = tuple(int(n) for n in reversed(t.shape.tolist()))
        plan.append((t, name))
    error = describe_mismatch(path, expected, found, unexpected)
    if error:
        raise ValueError(error)
    return plan


def iter_gguf(path: str, config: ModelConfig, shard=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor) for every weight in the GGUF file, one tensor dequantized at
    a time (float32 for quantized types, float16/bfloat16 kept as stored), Q/K un-permuted.
    The whole file is validated when this is called, before any tensor is read.
    shard(name, full_shape) -> (dim, start, end) | None: yield only that slice of each tensor
    (dequantized whole, one tensor at a time, then sliced)."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    plan = plan_gguf(reader, path, config)  # eager: errors raise at call time, not at first next()
    return _stream_gguf(plan, arch, config, shard)


def _stream_gguf(plan: list[tuple[Any, str]], arch: str, config: ModelConfig,
                 shard=None) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor, name in plan:
        w = _dequantize(tensor)
        if arch in _PERMUTED_QK and ".self_attn.q_proj." in name:
            w = unpermute_rows(w, config.num_attention_heads)
        elif arch in _PERMUTED_QK and ".self_attn.k_proj." in name:
            w = unpermute_rows(w, config.num_key_value_heads)
        if shard is not None:
            spec = shard(name, tuple(w.shape))
            if spec is not None:
                w = w.narrow(spec[0], spec[1], spec[2] - spec[1]).contiguous()
        yield name, w
