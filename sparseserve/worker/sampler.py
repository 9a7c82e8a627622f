"""Batched sampling on the device: logit_bias, repetition / frequency / presence penalties
(see `penalties.py`), grammar token bitmasks (see `grammar.py`), min_tokens' stop-token mask
(see `min_tokens.py`), temperature, top-k, top-p, min-p, seeds, logprobs.

One pass over the whole batch; per-row parameters are tensors, so no host sync happens per
request. Logprobs are those of the raw model distribution (vLLM's default "raw_logprobs"):
bias, penalties and masks change which token is picked, not the reported logprobs. Seeded rows draw their noise from a generator re-seeded from (seed, number of
tokens generated so far), which makes a request's samples independent of batching and of
preemption. Sampling uses the exponential-race trick: argmax(p / E), E ~ Exp(1), which
draws exactly from p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparseserve.request import SamplingParams
from sparseserve.worker.grammar import GrammarMasks
from sparseserve.worker.min_tokens import mask_stop_tokens, stop_token_index
from sparseserve.worker.penalties import PenaltyState, apply_logit_bias


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for the N rows being sampled this step."""

    params: list[SamplingParams]
    num_output_tokens: list[int]  # tokens each row generated so far
    # batch row (the runner's row) of each sampled row: where its penalty state lives;
    # None = row i of the batch is state row i (standalone use)
    rows: list[int] | None = None
    # per sampled row: its grammar matcher (llguidance.LLMatcher) or None (unconstrained).
    # The sampler only reads them; the engine advances each with the token it appends.
    grammars: list[Any] | None = None
    # per sampled row: the token ids it may not pick now (stop_token_ids + EOS while it has
    # generated fewer than min_tokens; () otherwise); None = no row has any
    stop_ids: list[tuple[int, ...]] | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    # when any row asked for logprobs: top-k values/ids [N, K], sampled logprob [N], rank [N]
    top_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    sampled_logprob: torch.Tensor | None = None
    sampled_rank: torch.Tensor | None = None


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._row_gen = torch.Generator(device=device)

        self.penalties = PenaltyState(device)
        self.grammar = GrammarMasks(device)

    def feed(self, fed: list[tuple[int, str, list[int]]], vocab_size: int) -> None:
        """Tokens entering the KV of rows whose request has penalties, this step:
        (row, request id, token ids). Call once per step before sampling (see penalties.py)."""
        self.penalties.feed(fed, vocab_size)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [N, V] fp32 -> SamplerOutput (token_ids [N] int64 on the device)."""
        params = batch.params
        greedy = [p.greedy for p in params]
        x = logits
        pen = [i for i, p in enumerate(params) if p.has_penalties]
        rows = batch.rows if batch.rows is not None else list(range(len(params)))
        gram = [i for i, m in enumerate(batch.grammars or ()) if m is not None]
        stop = [i for i, ids in enumerate(batch.stop_ids or ()) if ids]
        if pen or gram or stop or any(p.logit_bias for p in params):
            x = logits.clone()
            apply_logit_bias(x, params)
            if pen:
                pen_rows = [rows[i] for i in pen]
                self.penalties.prepare(pen_rows, [batch.num_output_tokens[i] for i in pen])
                pen_idx = torch.tensor(pen, device=logits.device)
                self.penalties.apply(x, pen_idx, pen_rows, [params[i] for i in pen])
            if gram:  # after bias and penalties: they cannot re-allow a forbidden token
                self.grammar.apply(x, gram, [batch.grammars[i] for i in gram])
            if stop:  # last: it keeps stop tokens only where the grammar allows nothing else
                mask_stop_tokens(x, stop_token_index(stop, [batch.stop_ids[i] for i in stop],
                                                     x.shape[1], x.device))
        if all(greedy):
            tokens = x.argmax(dim=-1)
        else:
            tokens = self._sample(x, batch, greedy)
        if pen:
            self.penalties.record(pen_rows, tokens[pen_idx])
        out = SamplerOutput(token_ids=tokens)
        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if k is not None:
            logp = torch.log_softmax(logits, dim=-1)
            sampled = logp.gather(1, tokens[:, None])[:, 0]
            out.sampled_logprob = sampled
            out.sampled_rank = (logp > sampled[:, None]).sum(dim=-1) + 1
            if k > 0:
                out.top_logprobs, out.top_ids = logp.topk(k, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch,
                greedy: list[bool]) -> torch.Tensor:
        params = batch.params
        dev = logits.device
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                             device=dev, dtype=torch.float32)
        x = logits / temps[:, None]
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
            x = self._top_k_top_p(x, params)
        probs = torch.softmax(x, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=torch.float32)
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None and not greedy[i]:
                self._row_gen.manual_seed(_stream_seed(p.seed, batch.num_output_tokens[i]))
                noise[i].exponential_(generator=self._row_gen)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            mask = torch.tensor(greedy, device=dev)
            sampled = torch.where(mask, logits.argmax(dim=-1), sampled)
        return sampled

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        dev = x.device
        vocab = x.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= top_k[:, None]
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        before = probs.cumsum(dim=-1) - probs
        drop |= before >= top_p[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)


def _stream_seed(seed: int, step: int) -> int:
    # distinct, well-mixed 63-bit seed per (request seed, output position)
    h = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1)
    return h ^ (h >> 29)
