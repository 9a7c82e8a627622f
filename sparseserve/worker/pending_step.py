"""What a ModelRunner step returns (`RunnerOutput`), and a step launched without waiting for
its tokens (async scheduling, engine/llm_engine.py).

With `async_scheduling` the engine schedules and launches step N + 1 while step N runs on the
device, then reads step N's tokens: the host's scheduling, input staging and launch (~0.8 ms
per decode step on the H200, the GPU idle meanwhile: serving.md, fifteenth session) overlap
the device's work. Step N + 1 is scheduled before step N's tokens are known, so a decode row
whose input is step N's token carries `request.PENDING_TOKEN`; the runner takes that token
from step N's sampled tokens on the device (`fill_pending_tokens`), never from the host.
The step's tokens, their logprobs (and the two-tier cache's working sets) are copied to
pinned host memory when it is launched and read when it is collected (`PendingStep`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparseserve.request import PENDING_TOKEN
from sparseserve.worker.host_copy import to_device


@dataclass
class RunnerOutput:
    """Sampled tokens of the chunks that sampled, keyed by request id."""

    token_ids: dict[str, int] = field(default_factory=dict)
    # request id -> {token_id: (logprob, rank)} for the sampled position
    logprobs: dict[str, dict[int, tuple[float, int]]] = field(default_factory=dict)
    # request id -> (first prompt position, {token_id: (logprob, rank)} per position) for
    # requests with prompt_logprobs whose prefill ran this step (see prompt_logprobs.py)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, tuple[float, int]]]]] = field(default_factory=dict)
    host_time_s: float = 0.0  # time the CPU spent preparing and launching (before the sync)
    logits: torch.Tensor | None = None  # [N, vocab] fp32 of the sampled rows (keep_logits)
    # two-tier cache: [max_num_seqs + 1] per-row working sets (slots per layer) counted this step
    working_sets: np.ndarray | None = None


@dataclass
class PendingStep:
    """What collecting a launched step needs. `ready`: the step sampled nothing (its
    RunnerOutput as is); else `result` (the RunnerOutput to fill), the sampled chunks, their
    SamplingBatch and sampler output (its tensors the pinned host copies in flight), the
    copies' event (None on CPU: nothing to wait for), and the working sets' host buffer
    (two-tier cache) or None."""
    ready: Any = None
    result: Any = None
    sampling: list = field(default_factory=list)
    batch: Any = None
    sampled: Any = None
    event: Any = None
    working_sets: torch.Tensor | None = None

    def tokens(self) -> list[int]:
        """The step's sampled token ids, in sampling order (waits for their copy only)."""
        if self.event is not None:
            self.event.synchronize()
        return self.sampled.token_ids.tolist()


def start_host_copy(tensors: list[torch.Tensor | None]) -> tuple[list, Any]:
    """Device tensors (None: skipped) -> (their pinned host copies in flight, one CUDA event
    after them). Reading the copies after the event does not wait for work queued later (the
    next step's). CPU tensors are already on the host: (them, None)."""
    if not any(t is not None and t.device.type == "cuda" for t in tensors):
        return list(tensors), None
    hosts = []
    for t in tensors:
        if t is None:
            hosts.append(None)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    event = torch.cuda.Event()
    event.record()
    return hosts, event


def fill_pending_tokens(input_ids: torch.Tensor, chunks, offsets: list[int],
                        last_tokens: torch.Tensor | None, last_index: dict[str, int]) -> int:
    """input_ids [T] (the step's tokens, chunk after chunk from `offsets`): a chunk whose last
    token is PENDING_TOKEN gets the token its request sampled in the previous launch,
    last_tokens[last_index[request_id]] (device to device, no host sync). Only a chunk's last
    token can be pending: the engine launches at most one step ahead. -> how many."""
    dst, src = [], []
    for c, off in zip(chunks, offsets):
        if c.token_ids and c.token_ids[-1] == PENDING_TOKEN:
            i = last_index.get(c.request_id)
            if last_tokens is None or i is None:
                raise RuntimeError(f"request {c.request_id}: its pending token was not "
                                   "sampled by the previous launch")
            dst.append(off + c.num_tokens - 1)
            src.append(i)
    if not dst:
        return 0
    idx = to_device(np.asarray(dst + src), torch.long, input_ids.device)
    n = len(dst)
    input_ids.index_copy_(0, idx[:n], last_tokens.index_select(0, idx[n:]).to(input_ids.dtype))
    return n
