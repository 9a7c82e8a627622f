"""Requests and their sampling parameters (CPU-side state only)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


# a token sampled by a step still on the device (async scheduling): its position is
# scheduled, its id is filled in on the device (worker/pending_step.py)
PENDING_TOKEN = -1


class RequestOutputKind(enum.IntEnum):
    """Which outputs `LLMEngine.step()` returns for a request (vLLM's names and values):
    CUMULATIVE, one after every step that gave it a token, each with everything so far
    (streaming); FINAL_ONLY, only the finished one (offline `LLM.generate` / `LLM.chat`: no
    per-step output is built, whose copies of the token ids, text and logprobs so far grow with
    the output). vLLM's DELTA is not offered: the server streams deltas of cumulative outputs."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; names, defaults and rules follow vLLM.

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p == 1 and
    min_p == 0 disable those filters. `logprobs` = number of top log-probabilities to return
    per generated token (plus the sampled token's own); `prompt_logprobs` the same for every
    prompt token after the first.

    Penalties (vLLM semantics, applied on the device before temperature):
    * repetition_penalty r (> 0, 1 = off): a logit of a token that occurs in the prompt or the
      output so far is divided by r when positive and multiplied by r when negative;
    * frequency_penalty f and presence_penalty p (in [-2, 2]): logit -= f * count + p * (count > 0),
      count = occurrences of the token in the output so far (not the prompt);
    * logit_bias {token id: bias}: added to the logit (values clamped to [-100, 100]).
    min_tokens (vLLM semantics): EOS and stop_token_ids cannot be sampled, and stop strings are
    not checked, until min_tokens tokens were generated; with structured_outputs the grammar
    wins (a grammar that can only end ends the request earlier; see worker/min_tokens.py).
    structured_outputs (vLLM's name): a `StructuredOutputsParams` (or a dict of its fields)
    constraining the output to a JSON schema, a regex, one of some choices or a Lark grammar;
    compiled with llguidance against the model's tokenizer when the request is added.
    Validation: `sparseserve.validation.check_sampling_params` (raises ParamError, a ValueError).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None  # StructuredOutputsParams | dict | None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise `ParamError` (a ValueError naming the field) if any value is out of range."""
        from sparseserve.validation import check_sampling_params
        check_sampling_params(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)  # a request is itself: identity equality (`req in running` stays cheap)
class Request:
    """One generation job. `all_token_ids` = prompt + output; the engine catches
    `num_computed_tokens` up with it (there is no separate prefill/decode phase)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.time)
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16  # resolved limit (max_model_len - prompt when params say None)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # async scheduling: tokens sampled by launched steps, not appended yet (at most 1 when
    # the scheduler runs); they count in num_tokens and read as PENDING_TOKEN
    num_pending: int = 0
    # Layer-segmented prefill: layers [0, prefill_layer) of the current chunk are done.
    prefill_layer: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # timings (seconds since the epoch) for metrics
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # per output token: list of {token_id: (logprob, rank)}
    logprobs: list[dict[int, tuple[float, int]]] = field(default_factory=list)
    # per prompt position (when prompt_logprobs is set): None for position 0 and for positions
    # not computed yet, else {token_id: (logprob, rank)} holding the prompt token and the top-k
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def min_tokens_stop_ids(self) -> tuple[int, ...]:
        """Token ids the sampler forbids until min_tokens tokens were generated: stop_token_ids
        and EOS (as vLLM, EOS even with ignore_eos); () without min_tokens (worker/min_tokens.py)."""
        p = self.sampling_params
        if p.min_tokens <= 0:
            return ()
        return tuple(sorted(set(p.stop_token_ids) | set(self.eos_token_ids)))

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (decode steps ask for one
        token of a long prompt every step); pending positions read PENDING_TOKEN."""
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        if end > known:
            head = self.token_slice(start, known) if start < known else []
            return head + [PENDING_TOKEN] * (end - max(start, known))
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
