"""EngineInfo: what the server's front end reads of an engine that runs in another process.

The request path (`serving.ServingContext`, the benchmark's in-process backend) reads
`model_name`, `max_model_len`, `vocab_size`, `tokenizer` and `grammar_backend(field)` from its
engine; the engine process sends these once, when it is ready, as this picklable object.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # the HF tokenizer (pickled across), or None for dummy weights
    eos_token_ids: tuple[int, ...]
    _grammar_backend: Optional[Any] = field(default=None, repr=False)

    @classmethod
    def of(cls, engine: Any) -> "EngineInfo":
        return cls(engine.model_name, int(engine.max_model_len), int(engine.vocab_size),
                   engine.tokenizer, tuple(engine.eos_token_ids))

    def grammar_backend(self, field: str = "structured_outputs") -> Any:
        """The front end's own llguidance compiler (requests are checked here before they are
        sent; the engine compiles its matchers itself)."""
        from sparseserve.structured.backend import lazy_backend
        return lazy_backend(self, field)
