"""Built-in architecture descriptions for `--load-format dummy` (random weights, no download).

Each entry is a Hugging Face style config.json dict, so it goes through the same
`ModelConfig.from_hf_dict` as a real checkpoint. The shapes copy the published configs of
the named models; only weights are missing (the model initialises them randomly), so
benchmarks measure the real memory footprint and FLOPs of those models.
"""
from __future__ import annotations

import copy
from typing import Any

from sparseserve.config import ModelConfig

_LLAMA_3_8B: dict[str, Any] = {
    # meta-llama/Meta-Llama-3-8B config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

_LLAMA_31_8B: dict[str, Any] = {
    # meta-llama/Llama-3.1-8B config.json: Llama-3-8B's shape with llama3 RoPE scaling to 128k
    **_LLAMA_3_8B,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
}

_LWM_7B: dict[str, Any] = {
    # LargeWorldModel/LWM-Text-Chat-1M: Llama-2-7B shape (MHA), RoPE theta raised for 1M context
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

BUILTIN_DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": _LLAMA_3_8B,
    "llama-3.1-8b": _LLAMA_31_8B,
    "lwm-7b": _LWM_7B,
}


def find_builtin(name: str) -> str | None:
    """The BUILTIN_DUMMY_CONFIGS key `name` refers to (case-insensitive), or None."""
    lowered = name.lower()
    return next((key for key in BUILTIN_DUMMY_CONFIGS if key == lowered), None)


def builtin_model_config(name: str) -> ModelConfig:
    """ModelConfig of a built-in dummy model; KeyError for an unknown name."""
    key = find_builtin(name)
    if key is None:
        raise KeyError(f"no built-in dummy config {name!r}; known: {sorted(BUILTIN_DUMMY_CONFIGS)}")
    # Deep copy: from_hf_dict keeps references to nested dicts (rope_scaling).
    return ModelConfig.from_hf_dict(copy.deepcopy(BUILTIN_DUMMY_CONFIGS[key]), name=key)
