"""Batched sampling on the device: logit_bias, repetition / frequency / presence penalties
(see `penalties.py`), grammar token bitmasks (see `grammar.py`), min_tokens' stop-token mask
(see `min_tokens.py`), temperature, top-k, top-p, min-p, seeds, logprobs.

One pass over the whole batch; per-row parameters are tensors, built once per batch composition
(see `sampling_tensors.py`), so no host sync happens per request and a steady decode batch
copies no parameters. Logprobs are those of the raw model distribution (vLLM's default "raw_logprobs"):
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
from sparseserve.worker.min_tokens import mask_stop_tokens
from sparseserve.worker.penalties import PenaltyState
from sparseserve.worker.sampling_tensors import SamplingTensorCache, SamplingTensors


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
    def __init__(self, device: torch.device, seed: int, max_rows: int | None = None) -> None:
        """max_rows: batch rows that can carry penalties (the runner's max_num_seqs): the
        penalty state never grows past them (the memory plan counts it at that size)."""
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._row_gen = torch.Generator(device=device)

        self.penalties = PenaltyState(device, max_rows)
        self.grammar = GrammarMasks(device)
        self.tensors = SamplingTensorCache()  # per-row parameter tensors, per composition

    def feed(self, fed: list[tuple[int, str, list[int]]], vocab_size: int) -> None:
        """Tokens entering the KV of rows whose request has penalties, this step:
        (row, request id, token ids). Call once per step before sampling (see penalties.py)."""
        self.penalties.feed(fed, vocab_size)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [N, V] fp32 -> SamplerOutput (token_ids [N] int64 on the device)."""
        params = batch.params
        rows = batch.rows if batch.rows is not None else list(range(len(params)))
        st = self.tensors.get(params, rows, batch.stop_ids, logits.shape[1], logits.dtype,
                              logits.device)
        x = logits
        pen = st.pen
        gram = [i for i, m in enumerate(batch.grammars or ()) if m is not None]
        if pen or gram or st.stop is not None or st.bias is not None:
            x = logits.clone()
            if st.bias is not None:
                x.index_put_(st.bias[:2], st.bias[2], accumulate=True)
            if pen:
                self.penalties.prepare(st.pen_rows, [batch.num_output_tokens[i] for i in pen])
                self.penalties.apply(x, st.pen_idx, st.pen_state_rows, st.pen_values)
            if gram:  # after bias and penalties: they cannot re-allow a forbidden token
                self.grammar.apply(x, gram, [batch.grammars[i] for i in gram])
            if st.stop is not None:  # last: it keeps stop tokens only where the grammar
                mask_stop_tokens(x, st.stop)  # allows nothing else
        if st.all_greedy:
            tokens = x.argmax(dim=-1)
        else:
            tokens = self._sample(x, batch, st)
        if pen:
            self.penalties.record(st.pen_rows, tokens[st.pen_idx], st.pen_state_rows)
        out = SamplerOutput(token_ids=tokens)
        k = st.logprobs
        if k is not None:
            logp = torch.log_softmax(logits, dim=-1)
            sampled = logp.gather(1, tokens[:, None])[:, 0]
            out.sampled_logprob = sampled
            out.sampled_rank = (logp > sampled[:, None]).sum(dim=-1) + 1
            if k > 0:
                out.top_logprobs, out.top_ids = logp.topk(k, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch,
                st: SamplingTensors) -> torch.Tensor:
        x = logits / st.temps[:, None]
        if st.top_k is not None:
            x = self._top_k_top_p(x, st.top_k, st.top_p)
        probs = torch.softmax(x, dim=-1)
        if st.min_p is not None:
            keep = probs >= st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, p in enumerate(batch.params):
            if p.seed is not None and not p.greedy:
                self._row_gen.manual_seed(_stream_seed(p.seed, batch.num_output_tokens[i]))
                noise[i].exponential_(generator=self._row_gen)
        sampled = (probs / noise).argmax(dim=-1)
        if st.greedy is not None:
            sampled = torch.where(st.greedy, logits.argmax(dim=-1), sampled)
        return sampled

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        vocab = x.shape[-1]
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=x.device)[None, :]
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
