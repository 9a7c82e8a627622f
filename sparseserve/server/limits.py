"""Server limits and their defaults, in one place (the CLI flags, `create_app` and the
handlers all read them from here).

`ServerLimits` is what a running server enforces per request:
* max_n                   largest `n` (and `best_of`) a request may ask for (--max-n)
* max_sequences           prompts x n (x best_of) sequences one request may start (--max-seqs-per-request)
* max_request_body_bytes  larger bodies answer 413 before they are parsed (--max-request-body-bytes)
* tokenizer_workers       threads that tokenize and apply chat templates (--tokenizer-workers)
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_N = 16
DEFAULT_MAX_SEQUENCES = 256
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_TOKENIZER_WORKERS = 2
# exit code of `sparseserve serve` when the shutdown timeout cut requests short
EXIT_REQUESTS_CUT = 3


@dataclass(frozen=True)
class ServerLimits:
    max_n: int = DEFAULT_MAX_N
    max_sequences: int = DEFAULT_MAX_SEQUENCES
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS

    def __post_init__(self) -> None:
        for name in ("max_n", "max_sequences", "max_request_body_bytes", "tokenizer_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
