"""Grammar compilation with llguidance, and one matcher per sequence.

Why llguidance (the three were compared on Python 3.11, CPU, SmolLM2's HF tokenizer, one
JSON schema, mask fill + apply at its start):
* xgrammar 0.2.9: CPU wheel, fast compile, but it requires torch, transformers, triton and
  apache-tvm-ffi (an install from a plain index can pull a CUDA torch), and filling a JSON
  mask cost ~0.2 ms per sequence (6.3 ms for 32).
* outlines-core 0.2.14: CPU wheel, no deps, but its `Vocabulary` is built from the Hub (or by
  hand from decoded token bytes) and its regex-DFA index is compiled eagerly over the whole
  vocabulary for every schema (seconds for larger schemas); no generic "any JSON" grammar.
* llguidance 1.6.1 (chosen): abi3 CPU wheel with no dependencies, a tokenizer from any HF
  tokenizer (`llguidance.hf.from_tokenizer`), JSON schema / regex / Lark grammars compiled
  lazily (~1 ms), masks ~0.06 ms per sequence (0.6 ms for 32), schema and regex errors as
  messages, and the int32 token-bitmask layout vLLM and xgrammar share. vLLM ships it as its
  "guidance" backend.

Contracts:
* `GrammarBackend(tokenizer, vocab_size, eos_token_id)` builds the llguidance tokenizer on
  first use (~0.5 s; thread-safe, so the server does it in a pool thread, off the engine).
* `grammar_of(spec)` -> llguidance grammar text (cached per constraint).
* `check(spec)` raises `ParamError` naming the request field when the grammar does not compile.
* `matcher(spec)` -> a fresh `llguidance.LLMatcher` at the start of the output (cheap; the
  compiled grammar is shared).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Optional

from sparseserve.structured.params import StructuredOutputsParams
from sparseserve.validation import ParamError

INSTALL_HINT = "pip install llguidance (it comes with sparseserve[server])"
_MAX_MESSAGE = 400


def lazy_backend(owner: Any, field: str) -> "GrammarBackend":
    """`owner`'s GrammarBackend, built on first use and kept in `owner._grammar_backend`;
    `owner` has `tokenizer`, `vocab_size`, `eos_token_ids` (the engine, or the server's view of
    an engine in another process). ParamError naming `field` when there is no tokenizer."""
    if owner.tokenizer is None:
        raise ParamError("Structured outputs need the model's tokenizer, and this model has none "
                         "(dummy weights); serve a model with a tokenizer or pass --tokenizer.",
                         field, "tokenizer_required")
    if owner._grammar_backend is None:
        eos = owner.eos_token_ids
        owner._grammar_backend = GrammarBackend(owner.tokenizer, owner.vocab_size,
                                                eos[0] if eos else None)
    return owner._grammar_backend


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError as e:  # pragma: no cover - an install without the server extra
        raise ParamError(f"structured outputs need the llguidance package; {INSTALL_HINT}.",
                         "structured_outputs") from e
    return llguidance


class GrammarBackend:
    """Compiles constraints for one tokenizer. Safe to call from several threads."""

    CACHE_SIZE = 256

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: Optional[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._grammars: OrderedDict[str, str] = OrderedDict()  # cache key -> checked grammar

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()
                self._ll_tokenizer = llg.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_id)
            return self._ll_tokenizer

    def grammar_of(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar of `spec`, checked against the tokenizer (ParamError if bad)."""
        key = spec.cache_key()
        with self._lock:
            hit = self._grammars.get(key)
            if hit is not None:
                self._grammars.move_to_end(key)
                return hit
        llg = _llguidance()
        matcher_cls = llg.LLMatcher
        try:
            grammar = self._build(matcher_cls, spec)
        except (ValueError, TypeError) as e:
            raise ParamError(f"{spec.field()} could not be compiled: {e}", spec.field(),
                             "invalid_grammar") from e
        error = matcher_cls.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ParamError(f"{spec.field()} could not be compiled: {_short(error)}", spec.field(),
                             "invalid_grammar")
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > self.CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    @staticmethod
    def _build(matcher_cls: Any, spec: StructuredOutputsParams) -> str:
        # compact JSON (no optional whitespace): a small model cannot loop on blanks
        opts = {"whitespace_flexible": False}
        kind = spec.kind
        if kind == "json":
            return matcher_cls.grammar_from_json_schema(spec.json, defaults=opts)
        if kind == "json_object":
            return matcher_cls.grammar_from_json_schema({"type": "object"}, defaults=opts)
        if kind == "regex":
            return matcher_cls.grammar_from_regex(spec.regex)
        if kind == "choice":  # Lark string literals take JSON escapes
            return matcher_cls.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return matcher_cls.grammar_from_lark(spec.grammar)

    def check(self, spec: StructuredOutputsParams) -> None:
        self.grammar_of(spec)

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A new matcher for one sequence (llguidance.LLMatcher)."""
        llg = _llguidance()
        m = llg.LLMatcher(self.ll_tokenizer, self.grammar_of(spec), log_level=0)
        if m.is_error():  # pragma: no cover - grammar_of validated it
            raise ParamError(f"{spec.field()} could not be compiled: {_short(m.get_error())}",
                             spec.field(), "invalid_grammar")
        return m


def _short(message: str) -> str:
    """The first lines of an llguidance message (it can append parser state dumps)."""
    text = " ".join(line.strip() for line in message.strip().splitlines()[:3] if line.strip())
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."
