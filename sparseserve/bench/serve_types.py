"""What the serving benchmark sends and what it measures, shared by the HTTP client, the
in-process backend, the metric math and the datasets.

Times are `time.perf_counter()` seconds: only differences of them are ever used.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol


@dataclass
class BenchRequest:
    """One request of a workload.

    Exactly one of `prompt` (text: the server tokenizes it) and `prompt_token_ids` (for
    models without a tokenizer, sent as a list of ints to /v1/completions) is set.
    `prompt_len` is the prompt's length as the workload built it (tokens of the client's
    tokenizer); the server's own count, from its `usage`, is what results report.
    `output_len` is `max_tokens`.
    """

    prompt_len: int
    output_len: int
    prompt: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    dataset: str = "random"

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("a BenchRequest has either a text prompt or prompt token ids, not both")


@dataclass
class RequestResult:
    """What one request measured, from the client's side.

    ttft: seconds from sending the request to the first generated token (None if none came).
    itl: seconds between consecutive token-carrying events after the first (a stream chunk
        may carry several tokens; then one gap stands for them, as in vLLM's benchmark).
    latency: seconds from sending to the end of the response (end-to-end latency).
    prompt_len / output_len: the server's `usage` counts when it sent them, else the
        client's prompt length and the number of token-carrying events (see `usage_source`).
    """

    success: bool = False
    ttft: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_len: int = 0
    output_len: int = 0
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0
    usage_source: str = "server"  # "server": usage of the final stream chunk; "chunks": counted
    dataset: str = ""


class Backend(Protocol):
    """Where requests go: the HTTP server (`serve_client.HTTPBackend`) or an engine in this
    process (`serve_inprocess.InProcessBackend`). Both measure the same way."""

    name: str

    async def start(self) -> None:
        """Open connections / start the engine loop; idempotent."""

    async def send(self, request: BenchRequest) -> RequestResult:
        """Run one request to the end. Never raises for a failed request: it returns a
        result with success False and the error text."""

    async def read_metrics(self) -> Optional[str]:
        """The Prometheus text of the server's /metrics (None where there is none)."""

    async def close(self) -> None:
        """Release what `start` opened."""
