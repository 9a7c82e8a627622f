"""Tokenizer of a model source: a Hugging Face tokenizer, from a directory or a GGUF file.

For GGUF files transformers rebuilds the tokenizer from the file's `tokenizer.ggml.*` arrays;
we then make sure what llama.cpp would do holds too: the chat template from
`tokenizer.chat_template`, BOS / EOS from the stored ids, and BOS added exactly when
`tokenizer.ggml.add_bos_token` says so.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from .gguf_file import field_value, open_gguf
from .source import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "tekken.json")


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> "PreTrainedTokenizerBase | None":
    """The tokenizer for `source`, or None where there is none.

    `tokenizer` (optional, vLLM's --tokenizer) overrides where it comes from: a HF directory or
    a .gguf file. HF directory: AutoTokenizer.from_pretrained(dir); None (with a warning) when
    the directory has no tokenizer files. GGUF file: transformers' GGUF tokenizer, checked
    against the file's metadata. Built-in dummy models: None (benchmarks pass token ids)."""
    path = os.path.expanduser(tokenizer) if tokenizer is not None else source.path
    if path is None:
        return None
    if not os.path.exists(path):
        raise FileNotFoundError(f"Tokenizer path {path!r} does not exist; pass a HF directory or a .gguf file.")
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, n)) for n in _TOKENIZER_FILES):
            if tokenizer is not None:
                raise FileNotFoundError(f"{path} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)}).")
            logger.warning("%s has no tokenizer files; serving %s with token ids only.", path, source.name)
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return load_gguf_tokenizer(path)


def load_gguf_tokenizer(path: str) -> "PreTrainedTokenizerBase":
    """transformers' tokenizer for the GGUF file at `path`, with chat template, BOS/EOS and
    the add-BOS behaviour taken from the file's metadata; from the GGUF cache (gguf_cache.py)
    after the first load."""
    from transformers import AutoTokenizer

    from . import gguf_cache

    path = os.path.abspath(path)
    hit = gguf_cache.cached(path, gguf_cache.TOKENIZER)
    if hit is not None:  # saved by a previous load, the fixes below applied
        return AutoTokenizer.from_pretrained(hit)
    tok = _from_gguf_metadata(path)
    gguf_cache.store_tokenizer(path, tok)
    return tok


def _from_gguf_metadata(path: str) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    reader = open_gguf(path)

    template = field_value(reader, "tokenizer.chat_template", None)
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template

    for attr, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding")):
        token_id = field_value(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None and getattr(tok, attr + "_id") != token_id:
            setattr(tok, attr, tok.convert_ids_to_tokens(int(token_id)))

    # llama.cpp adds BOS to sentencepiece ("llama") vocabularies unless the file says otherwise.
    default_add_bos = field_value(reader, "tokenizer.ggml.model", "") == "llama"
    want_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", default_add_bos))
    if tok.bos_token_id is not None and _adds_bos(tok) != want_bos:
        try:
            tok.add_bos_token = want_bos  # rebuilds the post-processor in transformers >= 5
        except AttributeError:
            pass
        if _adds_bos(tok) != want_bos:
            logger.warning("Tokenizer of %s %s BOS although the file says add_bos_token=%s.",
                           path, "adds" if not want_bos else "does not add", want_bos)
    return tok


def _adds_bos(tok: "PreTrainedTokenizerBase") -> bool:
    ids = tok("a")["input_ids"]
    return bool(ids) and ids[0] == tok.bos_token_id
