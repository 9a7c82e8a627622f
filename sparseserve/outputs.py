"""What the engine returns to callers (vLLM-shaped)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sampled sequence of a request. `text` and `token_ids` are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # one dict per generated token: {token_id: Logprob} (top-n plus the sampled token)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # per-token timestamps of the newest tokens (for inter-token latency metrics)
    new_token_times: list[float] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs (vLLM's shape): one entry per prompt token, None for
    # the first, else {token_id: Logprob} holding the prompt token and the top prompt_logprobs
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
