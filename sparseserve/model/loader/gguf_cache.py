"""A disk cache of what a GGUF file turns into: its config, its dequantized weights and its
tokenizer, as a Hugging Face folder.

Why: loading a GGUF parses every metadata field in Python (gguf-py reads the 49k-token
vocabulary and merges one field part at a time), dequantizes every tensor with numpy, and
transformers rebuilds a fast tokenizer from the vocabulary arrays. Measured on the 2-core CPU
machine for the embedded SmolLM2-135M Q4_1 (busy): 13 s parse, 10 s dequantize, 23 s
tokenizer; from the folder: a safetensors memory map and a ~1 s tokenizer load.

Layout: ``<cache dir>/gguf/<file stem>-<key>/`` with ``config.json`` (the HF config dict that
``gguf_file.gguf_hf_config`` derives), ``model.safetensors`` (what ``iter_gguf`` yields: HF
names, Q/K un-permuted, quantized types as float32, F16/BF16 as stored) and ``tokenizer/``
(``load_gguf_tokenizer``'s result, metadata fixes applied, saved by transformers). The key
hashes the file's absolute path, size and mtime, so an edited or replaced file misses. Each
part is written to a temporary name and renamed into place, so concurrent loaders (tensor-
parallel ranks, test processes) never see half a file. The source stays a GGUF source: only
where its parts are read from changes.

The cache lives in ``$SPARSESERVE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/sparseserve``, else
``~/.cache/sparseserve``); ``SPARSESERVE_GGUF_CACHE=0`` turns it off. Weights are cached only
while their dequantized size is at most ``MAX_WEIGHT_BYTES`` (a 4-bit 8B model would grow 8x
on disk; those load from the GGUF every time).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Any, Iterator

import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAX_WEIGHT_BYTES = 2 << 30
CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer"


def enabled() -> bool:
    return os.environ.get("SPARSESERVE_GGUF_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_root() -> str:
    root = os.environ.get("SPARSESERVE_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "sparseserve")
    return root


def entry_dir(gguf_path: str) -> str:
    """The cache folder of the GGUF file at `gguf_path` (it may not exist yet)."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = hashlib.sha1(f"{FORMAT_VERSION}|{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    stem = os.path.basename(path)
    stem = stem[:-len(".gguf")] if stem.endswith(".gguf") else stem
    return os.path.join(cache_root(), "gguf", f"{stem}-{key[:16]}")


def cached(gguf_path: str, part: str) -> str | None:
    """Path of a complete cached `part` (CONFIG, WEIGHTS or TOKENIZER) of the file, or None
    (cache off, not written yet, or the file changed since)."""
    if not enabled():
        return None
    p = os.path.join(entry_dir(gguf_path), part)
    return p if os.path.exists(p) else None


def _publish(tmp: str, final: str) -> None:
    """Move a finished temporary file or folder into place; a concurrent writer may have
    published the same content first, then ours is dropped."""
    try:
        os.replace(tmp, final)  # atomic; a folder only replaces a missing (or empty) one
    except OSError:
        if not os.path.exists(final):
            raise
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def _writable_entry(gguf_path: str) -> str | None:
    if not enabled():
        return None
    d = entry_dir(gguf_path)
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:  # read-only home etc.: serve without the cache
        logger.warning("GGUF cache disabled: cannot create %s (%s)", d, e)
        return None
    return d


def store_config(gguf_path: str, hf_config: dict[str, Any]) -> None:
    d = _writable_entry(gguf_path)
    if d is None:
        return
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".config.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=1)
    _publish(tmp, os.path.join(d, CONFIG))


def store_tokenizer(gguf_path: str, tokenizer: Any) -> None:
    d = _writable_entry(gguf_path)
    if d is None:
        return
    tmp = tempfile.mkdtemp(dir=d, prefix=".tokenizer.")
    tokenizer.save_pretrained(tmp)
    _publish(tmp, os.path.join(d, TOKENIZER))


def caching_weights(gguf_path: str,
                    weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `weights` unchanged and, once all of them went by, write them to the cache
    (skipped when the cache is off, or given up as soon as they pass MAX_WEIGHT_BYTES). The
    tensors are kept until then: the caller copies each into its parameter, so this holds
    one extra copy of a small model while it loads, once per file."""
    d = _writable_entry(gguf_path)
    kept: dict[str, torch.Tensor] | None = None if d is None else {}
    size = 0
    for name, w in weights:
        if kept is not None:
            size += w.numel() * w.element_size()
            if size > MAX_WEIGHT_BYTES:
                kept = None  # too big to cache: let go of what was kept
            else:
                kept[name] = w
        yield name, w
    if kept is None:
        return
    from safetensors.torch import save_file
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".weights.")
    os.close(fd)
    save_file({n: w.contiguous() for n, w in kept.items()}, tmp)
    _publish(tmp, os.path.join(d, WEIGHTS))
    logger.info("cached the dequantized weights of %s in %s", gguf_path, d)
