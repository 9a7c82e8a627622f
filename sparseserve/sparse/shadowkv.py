"""ShadowKV-style selection (Sun et al., "ShadowKV", 2024), adapted to pages: chunk landmarks
scored by a softmax over the whole request, and outlier chunks always kept.

ShadowKV, per KV head, splits the context into chunks of 8 post-RoPE keys, keeps the mean of
each chunk (its *landmark*), and at each decode step ranks chunks by the softmax of
``q · landmark * scale`` over all landmarks, max over the GQA group; chunks whose keys are badly
represented by their landmark (lowest minimum cosine similarity between the landmark and the
chunk's keys — 48 per head at a 2048-token budget) are *outliers*, never ranked, always
attended. Here pages (32 tokens of one KV head) stay the unit of selection, transfer and
caching; chunks are a partition inside the page (``page_size // 8`` per page):

* ``index``: per chunk the landmark (mean of its valid keys) and ``cosgap = 2 - min_t
  cos(k_t, landmark)`` over its valid keys, in ``[1, 3]``; ``0`` marks a chunk without keys
  (a partial page's empty chunk, or a row never indexed: zeroed rows can never pass for a
  chunk, whose landmark would score ``q · 0 = 0``, nor for an outlier). The offset keeps the
  common case (cos near 1) where bf16 is finest (steps of 2**-7 in [1, 2)).
* ``score``: per query head, ``softmax over every chunk of the row's full pages`` of
  ``q · landmark * D**-0.5`` (the partial last page has no summary yet; kept pages are in the
  normalisation, as in ``ref.mass_from_bounds``); per page the **max** over its chunks
  (``page_reduce``; "sum" — the page's estimated mass — measured against it in
  docs/results/data/fidelity_shadowkv.json); per KV head the max over the GQA group
  (ShadowKV's reduction: one head that singles out a chunk is enough). Scores are in [0, 1].
* **Outliers, per step:** ShadowKV's fixed count, chosen once at prefill, does not fit a page
  engine scoring each step over a growing row, so the rule is rank-based and budget-capped:
  among the *scored* pages (full, neither sink nor local), rank by the page's worst chunk
  (largest ``cosgap``); the first ``min(ceil(outlier_fraction * scored), cap)`` are outlier
  pages, ``cap = floor(outlier_budget_share * (budget_pages - sink_pages - local_pages))``
  (ShadowKV's 48 outlier chunks are 384 tokens next to a 2048-token budget, ~19 %; here the
  outliers are inside the budget, which counts the pages actually attended). An outlier page
  scores ``1 + cosgap`` in ``[2, 4]``, above every landmark score: it is kept like a sink /
  local page, within the budget, and its landmark score does not matter. Fixed shapes: one
  argsort per row, the count a tensor — no host sync, no data-dependent shapes, so a decode
  step stays capturable in a CUDA graph.

Measured (``benchmarks/fidelity_shadowkv.py``, SmolLM2-135M, 8k, 2 texts x 256 positions,
sink 1, local 2; docs/results/data/fidelity_shadowkv.json), top-1 agreement with dense at budget
512 / 2048: shadowkv 81.2 / 92.4 %, with the per-page sum 81.1 / 91.0 % (max kept), without
outlier pages 82.4 / 92.8 % (1 point = 5 positions: the outlier rule does not help here; set
``outlier_fraction = 0`` to drop it); arkvale 78.5 / 84.8, keycode2 94.5 / 98.4, oracle
94.9 / 98.8.

Left out: ShadowKV's low-rank (SVD) pre-RoPE key cache and on-the-fly key reconstruction. That
is ShadowKV's *memory* scheme (keys compressed in HBM, values offloaded); this engine keeps
exact K/V pages in DRAM and a device cache of pages in HBM (``transfer/``, the two-tier cache),
so only the selection — which pages to attend — is ShadowKV's here, and it is measured for
selection quality against the other algorithms on the same exact pages.

Summaries per page and KV head: ``landmarks`` ``(page_size // 8, head_dim)`` and ``cosgap``
``(page_size // 8,)``, KV dtype: at page 32, head_dim 64, bf16, 4 * 64 * 2 + 4 * 2 = 520 B of
8 KiB of K+V (6.3 %; Quest/ArkVale 3.1 %, 8-token boxes 12.5 %, keycode2 9.4 %). Torch only (no
fused kernel): ``select`` is the shared one over ``score``.
"""
from __future__ import annotations

import math

import torch

from sparseserve.sparse.base import SparseAlgorithm, register


@register("shadowkv")
class ShadowKV(SparseAlgorithm):
    summary_names = ("landmarks", "cosgap")
    chunk_tokens = 8  # tokens per landmark chunk (ShadowKV's chunk size)
    page_reduce = "max"  # chunk scores -> page score: "max" or "sum" (over the page's chunks)
    outlier_fraction = 0.02  # of the row's scored pages, by their worst chunk
    outlier_budget_share = 0.25  # at most this share of the scored budget goes to outliers

    def __init__(self, page_size, budget_pages, sink_pages, local_pages):
        super().__init__(page_size, budget_pages, sink_pages, local_pages)
        t = min(self.chunk_tokens, page_size)
        if page_size % t:
            raise ValueError(f"{self.name}: chunk_tokens {t} must divide page_size {page_size}")
        self.chunk = t
        self.n_chunks = page_size // t  # landmarks per page
        scored_budget = max(0, budget_pages - sink_pages - local_pages)
        self.outlier_cap = math.floor(self.outlier_budget_share * scored_budget)

    def summary_shapes(self, head_dim):
        return {"landmarks": (self.n_chunks, head_dim), "cosgap": (self.n_chunks,)}

    # ---- index ------------------------------------------------------------------------------
    def index(self, k_cache, page_ids, num_tokens, summaries, queries):
        """k_cache [P, ps, D]; page_ids [N] int32 (< 0 masked -> the last summary row, a
        scratch row); num_tokens [N] int32. Writes each listed page's row of ``landmarks``
        [S, C * D] (C = ps // chunk) and ``cosgap`` [S, C]."""
        lm_t, gap_t = summaries["landmarks"], summaries["cosgap"]
        live = page_ids >= 0                                                  # [N]
        rows = torch.where(live, page_ids, lm_t.shape[0] - 1).long()         # [N]
        k = k_cache[torch.where(live, page_ids, 0).long()].float()           # [N, ps, D]
        n, ps, d = k.shape
        c, t = self.n_chunks, self.chunk
        k = k.view(n, c, t, d)                                               # [N, C, T, D]
        pos = torch.arange(ps, device=k.device).view(1, c, t)
        ok = pos < num_tokens.long().view(-1, 1, 1)                          # [N, C, T]
        cnt = ok.sum(-1)                                                     # [N, C]
        k = torch.where(ok.unsqueeze(-1), k, 0.0)
        lm = k.sum(2) / cnt.clamp(min=1).unsqueeze(-1).float()               # [N, C, D]
        cos = torch.nn.functional.cosine_similarity(k, lm.unsqueeze(2), dim=-1)  # [N, C, T]
        mincos = torch.where(ok, cos, float("inf")).amin(-1)                 # [N, C]
        has = cnt > 0
        gap = torch.where(has, 2.0 - mincos.clamp(-1.0, 1.0), 0.0)           # [N, C]
        lm_t[rows] = lm.reshape(n, c * d).to(lm_t.dtype)
        gap_t[rows] = gap.to(gap_t.dtype)

    # ---- score ------------------------------------------------------------------------------
    def chunk_logits(self, q, page_table, num_pages, summaries):
        """(x [B, Hkv, G, W, C] float32 = q · landmark (unscaled), cosgap [B, Hkv, W, C]
        float32) of each entry's chunks; entries past num_pages read page 0 (masked later).
        The fidelity harness overrides this alone (one summary read for rows sharing pages)."""
        B, hq, D = q.shape
        hkv, W = page_table.shape[1:]
        c = self.n_chunks
        blk = torch.arange(W, device=q.device).view(1, 1, W)
        ids = torch.where(blk < num_pages.long().unsqueeze(-1), page_table.long(), 0)
        lm = summaries["landmarks"].view(-1, c, D)[ids].float()             # [B, Hkv, W, C, D]
        gap = summaries["cosgap"].view(-1, c)[ids].float()                  # [B, Hkv, W, C]
        x = torch.einsum("bhgd,bhwcd->bhgwc", q.float().view(B, hkv, hq // hkv, D), lm)
        return x, gap

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """q [B, Hq, D], page_table [B, Hkv, W], num_pages [B, Hkv] -> [B, Hkv, W] float32:
        landmark score in [0, 1], outlier pages in [2, 4], -inf past num_pages."""
        x, gap = self.chunk_logits(q, page_table, num_pages, summaries)
        return self.from_chunk_logits(x, gap, num_pages, q.shape[-1] ** -0.5)

    def from_chunk_logits(self, x, gap, num_pages, scale):
        """Page scores [B, Hkv, W] from chunk logits x [B, Hkv, G, W, C] (unscaled) and
        cosgap [B, Hkv, W, C] (x, gap may broadcast over B)."""
        W = x.shape[3]
        n = num_pages.long().unsqueeze(-1)                                   # [B, Hkv, 1]
        blk = torch.arange(W, device=x.device).view(1, 1, W)
        full = blk < n - 1                       # pages with a summary (not the last one)
        valid = full.unsqueeze(-1) & (gap > 0.5)                             # [B, Hkv, W, C]
        xs = (x.float() * scale).masked_fill(~valid.unsqueeze(2), float("-inf"))
        B, hkv = valid.shape[:2]
        lse = torch.logsumexp(xs.reshape(B, hkv, xs.shape[2], -1), dim=-1)  # [B, Hkv, G]
        lse = torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1)      # no chunk: any
        if self.page_reduce == "sum":
            r = torch.logsumexp(xs, dim=-1)                                  # [B, Hkv, G, W]
        else:
            r = xs.amax(dim=-1)
        p = torch.exp(r - lse).amax(dim=2)                                   # [B, Hkv, W]
        # outliers: the scored pages whose worst chunk is least like its landmark
        worst = torch.where(valid, gap, 0.0).amax(dim=-1)                    # [B, Hkv, W]
        cand = full & (blk >= self.sink_pages) & (blk < n - self.local_pages) & (worst > 0.5)
        if self.outlier_cap > 0 and self.outlier_fraction > 0:
            bad = torch.where(cand, worst, float("-inf"))
            order = bad.argsort(dim=-1, descending=True)
            rank = torch.empty_like(order).scatter_(
                -1, order, torch.arange(W, device=x.device).expand_as(order))
            n_out = torch.ceil(cand.sum(-1, keepdim=True).float() * self.outlier_fraction)
            n_out = n_out.clamp(max=self.outlier_cap)                        # [B, Hkv, 1]
            p = torch.where(cand & (rank < n_out), 1.0 + worst, p)
        return p.masked_fill(blk >= n, float("-inf"))
