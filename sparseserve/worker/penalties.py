"""Repetition / frequency / presence penalties and logit_bias, batched on the device.

State per batch row, on the device, for the rows whose request has penalties (allocated on
first use, grown to the highest row seen, never past the batch's rows: the memory plan
counts [max_num_seqs, V] of it):
  seen   [R, V] bool   token occurs in the request's prompt or output so far
  counts [R, V] int32  occurrences of the token in the output so far

It is kept up to date without any host sync (host token lists reach the device as pinned,
non-blocking copies: `host_copy.to_device`): `feed` scatters the tokens entering a row's KV
this step (prompt chunks, decode tokens) into `seen`; `record` adds each sampled token to
`counts` and `seen` (device index ops on the sampled-token tensor). A row is re-bound (and
zeroed) when a different request takes it. A request resumed on a new row after preemption
by recompute re-feeds prompt + output tokens; its counts are rebuilt at its first sampling
from the last `num_output_tokens` tokens fed (kept on the host only until that first sample).

Formulas (vLLM, OpenAI), applied to the logits before temperature:
  logit_bias:          x[t] += bias[t]
  repetition penalty:  x[t] = x[t] / r if x[t] > 0 else x[t] * r,  for t in seen
  frequency/presence:  x[t] -= f * counts[t] + p * (counts[t] > 0)
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from sparseserve.worker.host_copy import fill_at, to_device


class PenaltyState:
    def __init__(self, device: torch.device, max_rows: int | None = None) -> None:
        """max_rows: rows that can ever be fed (None: unbounded); growth stops there."""
        self.device = device
        self.max_rows = max_rows
        self.seen: torch.Tensor | None = None    # [R, V] bool
        self.counts: torch.Tensor | None = None  # [R, V] int32
        self.bound: dict[int, str] = {}          # row -> request id whose state it holds
        self.num_recorded: dict[int, int] = {}   # row -> output tokens counted in `counts`
        self.pending: dict[int, list[int]] = {}  # row -> tokens fed before its first sample

    def _ensure(self, max_row: int, vocab: int) -> None:
        rows = 0 if self.seen is None else self.seen.shape[0]
        if self.seen is not None and max_row < rows and self.seen.shape[1] == vocab:
            return
        new_rows = max(max_row + 1, 2 * rows, 8)
        if self.max_rows is not None:  # doubling past the batch rows would waste HBM
            new_rows = max(max_row + 1, min(new_rows, self.max_rows))
        seen = torch.zeros((new_rows, vocab), dtype=torch.bool, device=self.device)
        counts = torch.zeros((new_rows, vocab), dtype=torch.int32, device=self.device)
        if self.seen is not None and self.seen.shape[1] == vocab:
            seen[:rows] = self.seen
            counts[:rows] = self.counts
        self.seen, self.counts = seen, counts

    def feed(self, fed: Sequence[tuple[int, str, Sequence[int]]], vocab: int) -> None:
        """Tokens entering each penalized row's KV this step: (row, request id, token ids)."""
        if not fed:
            return
        self._ensure(max(r for r, _, _ in fed), vocab)
        reset, rows, toks = [], [], []
        for row, rid, ids in fed:
            if self.bound.get(row) != rid:
                self.bound[row] = rid
                self.num_recorded[row] = 0
                self.pending[row] = []
                reset.append(row)
            if row in self.pending:
                self.pending[row].extend(ids)
            rows.extend([row] * len(ids))
            toks.extend(ids)
        if reset:
            idx = to_device(reset, torch.long, self.device)
            self.seen.index_fill_(0, idx, False)
            self.counts.index_fill_(0, idx, 0)
        if toks:
            at = to_device([rows, toks], torch.long, self.device)  # [2, N]: one copy
            fill_at(self.seen, (at[0], at[1]), True)

    def prepare(self, rows: Sequence[int], num_output_tokens: Sequence[int]) -> None:
        """Before sampling: rebuild the counts of rows whose request resumed with outputs the
        state has not counted (preemption by recompute onto a fresh row)."""
        for row, k in zip(rows, num_output_tokens):
            if self.num_recorded.get(row, 0) != k:
                fed = self.pending.get(row) or []
                outs = fed[len(fed) - k:] if k else []
                self.counts[row].zero_()
                if outs:
                    t = to_device(outs, torch.long, self.device)
                    self.counts[row].index_add_(0, t, torch.ones_like(t, dtype=torch.int32))
                self.num_recorded[row] = k
            self.pending.pop(row, None)

    def apply(self, logits: torch.Tensor, batch_idx: torch.Tensor, state_rows: torch.Tensor,
              values: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """In place on logits [N, V]: penalties for the batch rows `batch_idx` [P] whose
        state rows are `state_rows` [P]; values = (repetition, frequency, presence) [P] each,
        in the logits' dtype (see sampling_tensors.py)."""
        rep, freq, pres = values
        x = logits[batch_idx]
        seen = self.seen[state_rows]
        counts = self.counts[state_rows].to(x.dtype)
        pen = torch.where(seen, rep[:, None], torch.ones_like(x))
        x = torch.where(x > 0, x / pen, x * pen)
        x = x - freq[:, None] * counts - pres[:, None] * (counts > 0).to(x.dtype)
        logits[batch_idx] = x

    def record(self, rows: Sequence[int], sampled: torch.Tensor,
               idx: torch.Tensor | None = None) -> None:
        """After sampling: sampled [P] int64 (device) are the new output tokens of `rows`
        (`idx`: the same rows as a device tensor, if the caller has it)."""
        if idx is None:
            idx = to_device(list(rows), torch.long, sampled.device)
        self.counts.index_put_((idx, sampled), torch.ones_like(sampled, dtype=torch.int32),
                               accumulate=True)
        fill_at(self.seen, (idx, sampled), True)
        for row in rows:
            self.num_recorded[row] = self.num_recorded.get(row, 0) + 1


def apply_logit_bias(logits: torch.Tensor, params: Sequence[Any]) -> None:
    """In place: logits[i, t] += params[i].logit_bias[t] (one index_put)."""
    index = logit_bias_index(params, logits.device, logits.dtype)
    if index is not None:
        logits.index_put_(index[:2], index[2], accumulate=True)


def logit_bias_index(params: Sequence[Any], device: torch.device,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, token ids, values) of every row's logit_bias, for one accumulating index_put;
    None without any. Each SamplingParams caches its bias as two device tensors, so a build
    costs one concatenation per part."""
    rows, toks, vals = [], [], []
    for i, p in enumerate(params):
        if not p.logit_bias:
            continue
        cached = getattr(p, "_logit_bias_tensors", None)
        if cached is None or cached[0].device != device:
            ids = to_device(list(p.logit_bias.keys()), torch.long, device)
            v = to_device(list(p.logit_bias.values()), dtype, device)
            cached = (ids, v)
            object.__setattr__(p, "_logit_bias_tensors", cached)
        rows.append(torch.full_like(cached[0], i))
        toks.append(cached[0])
        vals.append(cached[1])
    if not rows:
        return None
    return torch.cat(rows), torch.cat(toks), torch.cat(vals).to(dtype)
