"""Weight and tokenizer loading: Hugging Face safetensors directories, GGUF files, dummy configs.

    source = resolve_model_source(args.model, args.load_format)   # validates everything up front
    config = load_model_config(source)
    for name, tensor in iter_weights(source, config): ...        # HF parameter names, CPU tensors
    tokenizer = load_tokenizer(source)                            # None for built-in dummy models
"""
from .dummy import BUILTIN_DUMMY_CONFIGS
from .gguf_file import supported_types as supported_gguf_types
from .hf import expected_weight_shapes
from .source import (
    DEFAULT_MODEL_NAME,
    LOAD_FORMATS,
    ModelSource,
    check_weights,
    default_model_path,
    iter_weights,
    load_model_config,
    resolve_model_source,
)
from .tokenizer import load_tokenizer

__all__ = [
    "BUILTIN_DUMMY_CONFIGS",
    "DEFAULT_MODEL_NAME",
    "LOAD_FORMATS",
    "ModelSource",
    "check_weights",
    "default_model_path",
    "expected_weight_shapes",
    "iter_weights",
    "load_model_config",
    "load_tokenizer",
    "resolve_model_source",
    "supported_gguf_types",
]
