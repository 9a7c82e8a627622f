"""The sampler's per-row parameters as device tensors, built once per batch composition.

Consecutive decode steps usually sample the same requests in the same rows, so the tensors
(temperature, top-k, top-p, min-p, the greedy mask; penalty rows and values; the logit_bias
entries; min_tokens' stop-token entries) are rebuilt only when the composition changes: which
SamplingParams object is at which sampled position and batch row, and which rows still mask
stop tokens (a row crossing min_tokens changes it). On a GPU each build is a handful of small
host->device copies from pinned memory, none of which stalls the host (`host_copy.to_device`);
a steady decode batch pays none.

The key holds the params objects themselves (by identity; the cache keeps them referenced, so
an id is never reused while cached). SamplingParams are treated as immutable while their
request runs, as the logit_bias cache on each params object already assumes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from sparseserve.worker.host_copy import to_device
from sparseserve.worker.min_tokens import stop_token_index
from sparseserve.worker.penalties import logit_bias_index


@dataclass
class SamplingTensors:
    params: list[Any]
    all_greedy: bool
    greedy: torch.Tensor | None      # [N] bool, when some rows (not all) are greedy
    temps: torch.Tensor | None       # [N] fp32 (1 for greedy rows), unless all are greedy
    top_k: torch.Tensor | None       # [N] (vocab = off), when a row uses top-k or top-p
    top_p: torch.Tensor | None       # [N] fp32, with top_k
    min_p: torch.Tensor | None       # [N] fp32, when a row uses min-p
    pen: list[int]                   # sampled positions with penalties
    pen_rows: list[int]              # their batch rows (penalty state rows)
    pen_idx: torch.Tensor | None     # [P] positions
    pen_state_rows: torch.Tensor | None  # [P] rows
    pen_values: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # repetition, frequency,
    #                                  presence [P], in the logits' dtype
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # logit_bias (rows, ids, values)
    stop: tuple[torch.Tensor, ...] | None  # stop_token_index of the rows below min_tokens
    logprobs: int | None             # the largest logprobs asked for (None: none)


def build(params: Sequence[Any], rows: Sequence[int], stop_ids: Sequence[Sequence[int]] | None,
          vocab: int, dtype: torch.dtype, device: torch.device) -> SamplingTensors:
    def t(values, dt=None):
        return to_device(values, dt, device)

    greedy = [p.greedy for p in params]
    all_greedy = all(greedy)
    filters = any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params)
    pen = [i for i, p in enumerate(params) if p.has_penalties]
    pen_rows = [rows[i] for i in pen]
    stop = [i for i, ids in enumerate(stop_ids or ()) if ids]
    return SamplingTensors(
        params=list(params),
        all_greedy=all_greedy,
        greedy=t(greedy) if any(greedy) and not all_greedy else None,
        temps=None if all_greedy else t([p.temperature if p.temperature > 0 else 1.0
                                         for p in params], torch.float32),
        top_k=t([p.top_k if p.top_k > 0 else vocab for p in params])
        if filters and not all_greedy else None,
        top_p=t([p.top_p for p in params], torch.float32) if filters and not all_greedy else None,
        min_p=t([p.min_p for p in params], torch.float32)
        if not all_greedy and any(p.min_p > 0 for p in params) else None,
        pen=pen,
        pen_rows=pen_rows,
        pen_idx=t(pen) if pen else None,
        pen_state_rows=t(pen_rows) if pen else None,
        pen_values=tuple(t([getattr(params[i], name) for i in pen], dtype) for name in
                         ("repetition_penalty", "frequency_penalty", "presence_penalty"))
        if pen else None,
        bias=logit_bias_index(params, device, dtype),
        stop=stop_token_index(stop, [stop_ids[i] for i in stop], vocab, device) if stop else None,
        logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None))


class SamplingTensorCache:
    """The tensors of the last composition; `get` rebuilds them only when it changed."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._tensors: SamplingTensors | None = None
        self.builds = 0  # how many times the tensors were built (tests, measurements)

    def get(self, params: Sequence[Any], rows: Sequence[int],
            stop_ids: Sequence[Sequence[int]] | None, vocab: int, dtype: torch.dtype,
            device: torch.device) -> SamplingTensors:
        key = (tuple(map(id, params)), tuple(rows),
               tuple(stop_ids) if stop_ids is not None else None, vocab, dtype, device)
        if key != self._key or self._tensors is None:
            self._tensors = build(params, rows, stop_ids, vocab, dtype, device)
            self._key = key
            self.builds += 1
        return self._tensors
