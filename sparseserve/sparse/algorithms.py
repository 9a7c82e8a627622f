"""The sparse algorithms: dense (oracle of everything), quest, arkvale, infllm, streaming,
and `oracle` (exact top-k pages by true attention mass; an evaluation reference)."""
from __future__ import annotations

import os

import torch

from sparseserve.kernels import head_bounds, select_pages, update_page_summaries
from sparseserve.kernels.ref import mass_from_bounds, sub_page_rows
from sparseserve.sparse.base import Selection, SparseAlgorithm, register


@register("dense")
class Dense(SparseAlgorithm):
    """Selects every page: the engine runs plain paged decode for it."""

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        blk = torch.arange(page_table.shape[2], device=q.device).view(1, 1, -1)
        return torch.where(blk < num_pages.unsqueeze(-1), 0.0, float("-inf")).float().expand(
            page_table.shape).contiguous()


@register("quest")
class Quest(SparseAlgorithm):
    """Per-channel key min/max; per query head g the bound u_g = sum_c max(q_gc M_c, q_gc m_c)
    of q_g·k over the page. A page's score is its estimated attention mass summed over the GQA
    group: sum_g softmax_w(u_g * D**-0.5) over the row's full pages (``ref.mass_from_bounds``;
    the kept pages are in the normalisation, the partial last page is not). Each head thus
    spends a total of 1, so one head that singles out a page is not drowned by the group's
    other heads' large, flat bounds, as it is when raw bounds are summed (measured in
    docs/results/fidelity.md; the raw sum is kept as the ``quest-sum`` evaluation variant)."""

    summary_names = ("kmin", "kmax")
    # one fused kernel for score + kept pages + top-k (kernels.select_pages); False, or
    # SPARSESERVE_FUSED_SELECT=0 in the environment, falls back to the generic torch select
    fused_select = os.environ.get("SPARSESERVE_FUSED_SELECT", "1") not in ("0", "")
    select_splits = None  # score programs per row (None: select_pages' heuristic / env)
    # tokens per summary box; None = the whole page. Smaller boxes (sparse/subpage.py) keep
    # page_size // box_tokens boxes per page and bound a page by the max of its boxes' bounds
    box_tokens: int | None = None

    def __init__(self, page_size, budget_pages, sink_pages, local_pages):
        super().__init__(page_size, budget_pages, sink_pages, local_pages)
        box = min(self.box_tokens or page_size, page_size)
        if page_size % box:
            raise ValueError(f"{self.name}: box_tokens {box} must divide page_size {page_size}")
        self.n_sub = page_size // box  # boxes per page

    def summary_shapes(self, head_dim):
        return {n: (self.n_sub, head_dim) for n in self.summary_names}

    def _boxes(self, summaries):
        """The kmin / kmax summaries as [rows * n_sub, D] (one row per box)."""
        return (summaries["kmin"].view(-1, summaries["kmin"].shape[1] // self.n_sub),
                summaries["kmax"].view(-1, summaries["kmax"].shape[1] // self.n_sub))

    @property
    def indexes_apart(self) -> bool:  # SparseAlgorithm.indexes_apart: one box per page
        return self.n_sub == 1

    def _index_boxes(self, k_cache, page_ids, num_tokens, kmin, kmax, box=False,
                     write_ids=None):
        """Per-box min / max of the listed pages (rows [S * n_sub, D]); `box`: ArkVale's box
        [c - r, c + r] of each instead (kernels.update_page_summaries); `write_ids` (one box
        per page only): the rows they go to, instead of the pages' own."""
        n = self.n_sub
        if n == 1:
            update_page_summaries(k_cache, page_ids, num_tokens, kmin, kmax, box=box,
                                  write_ids=write_ids)
            return
        assert write_ids is None, "sub-page boxes are written at their pages' rows"
        P, ps, D = k_cache.shape
        ids, ntok = sub_page_rows(page_ids, num_tokens, n, ps // n)
        update_page_summaries(k_cache.reshape(P * n, ps // n, D), ids, ntok, kmin, kmax,
                              box=box)
        # boxes without a valid token (a partial page) repeat box 0: the page's max unchanged
        S = kmin.shape[0] // n
        rows = torch.where(page_ids >= 0, page_ids, S - 1).long()  # masked -> scratch row
        empty = (torch.arange(n, device=page_ids.device).view(1, n, 1) * (ps // n)
                 >= num_tokens.view(-1, 1, 1))
        for t in (kmin, kmax):
            v = t.view(S, n, D)
            cur = v[rows]
            v[rows] = torch.where(empty, cur[:, :1], cur)

    def index(self, k_cache, page_ids, num_tokens, summaries, queries, write_ids=None):
        kmin, kmax = self._boxes(summaries)
        self._index_boxes(k_cache, page_ids, num_tokens, kmin, kmax, write_ids=write_ids)

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """[B, Hkv, W] float32: mass of scored pages, +inf kept / last page, -inf past n."""
        kmin, kmax = summaries["kmin"], summaries["kmax"]
        u = head_bounds(q, kmin, kmax, page_table, num_pages, n_sub=self.n_sub)
        return self.from_bounds(u, num_pages, q.shape[-1] ** -0.5)

    def from_bounds(self, bounds, num_pages, scale):
        """Page scores [B, Hkv, W] from per-query-head bounds [B, Hkv, G, W] (-inf past
        num_pages): the estimated attention mass. Evaluation variants override this alone."""
        return mass_from_bounds(bounds, num_pages, self.sink_pages, self.local_pages, scale)

    def select(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """The base select's Selection (same set of pages, entries in block order on the GPU)
        from one fused kernel: select dominated sparse decode as ~27 separate ops."""
        # the fused kernel computes Quest's mass score itself: a subclass that scores
        # differently goes through the generic path
        cls = type(self)
        if not self.fused_select or cls.score is not Quest.score \
                or cls.from_bounds is not Quest.from_bounds:
            return super().select(q, page_table, num_pages, last_page_len, summaries, k_cache)
        pages, num_sel, blocks = select_pages(
            q, summaries["kmin"], summaries["kmax"], page_table, num_pages, last_page_len,
            self.budget_pages, self.sink_pages, self.local_pages, n_sub=self.n_sub,
            num_splits=self.select_splits)
        return Selection(pages, num_sel, last_page_len, blocks)


@register("arkvale")
class ArkVale(Quest):
    """Cuboid-mean: centre c = (M+m)/2, radius r = mean_t |c - k_t|; per query head the bound
    sum_c max(q_c (c+r)_c, q_c (c-r)_c), scored by estimated attention mass like Quest.

    That bound is Quest's on the box [c - r, c + r], so the box is what we store (two vectors
    per page, like Quest: summaries stay at 2/page_size of the KV bytes) and scoring and the
    fused select reuse Quest's kernels."""

    def index(self, k_cache, page_ids, num_tokens, summaries, queries, write_ids=None):
        # each listed page's box [c - r, c + r] in one summary launch (c: the min-max
        # centre, r: the mean |c - k| per channel, each rounded to the summary dtype first)
        kmin, kmax = self._boxes(summaries)
        self._index_boxes(k_cache, page_ids, num_tokens, kmin, kmax, box=True,
                          write_ids=write_ids)


@register("infllm")
class InfLLM(SparseAlgorithm):
    """Representative key per page: the mean of the page's keys that the local queries attend
    to most (InfLLM's representative tokens); score = sum over the group's heads of q·rep."""

    summary_names = ("rep",)
    uses_queries = True
    num_representatives = 4

    def index(self, k_cache, page_ids, num_tokens, summaries, queries):
        rep = summaries["rep"]
        live = page_ids >= 0
        rows = torch.where(live, page_ids, rep.shape[0] - 1).long()  # masked lanes -> scratch row
        k = k_cache[torch.where(live, page_ids, 0).long()].float()  # [N, ps, D]
        valid = torch.arange(k.shape[1], device=k.device)[None, :] < num_tokens[:, None]
        if queries is None:
            w = valid.float()
        else:  # attention the page's keys receive from the queries that filled it
            w = torch.einsum("ngd,ntd->nt", queries.float(), k).masked_fill(~valid, float("-inf"))
        top = w.topk(min(self.num_representatives, k.shape[1]), dim=-1).indices  # [N, r]
        chosen = k.gather(1, top.unsqueeze(-1).expand(-1, -1, k.shape[2]))
        ok = valid.gather(1, top).unsqueeze(-1).float()
        rep[rows] = ((chosen * ok).sum(1) / ok.sum(1).clamp(min=1)).to(rep.dtype)

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        B, hq, D = q.shape
        hkv, W = page_table.shape[1:]
        rep = summaries["rep"][page_table.long()].float()  # [B, Hkv, W, D]
        qg = q.float().view(B, hkv, hq // hkv, D).sum(2)  # sum over the group's heads
        s = torch.einsum("bhd,bhwd->bhw", qg, rep)
        blk = torch.arange(W, device=q.device).view(1, 1, W)
        return s.masked_fill(blk >= num_pages.unsqueeze(-1), float("-inf"))


@register("streaming")
class Streaming(SparseAlgorithm):
    """StreamingLLM: the sink pages plus the most recent pages, filling the same budget."""

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        blk = torch.arange(page_table.shape[2], device=q.device).view(1, 1, -1).float()
        recency = blk.expand(page_table.shape)  # later pages score higher
        return recency.masked_fill(blk >= num_pages.unsqueeze(-1), float("-inf"))


@register("oracle")
class Oracle(SparseAlgorithm):
    """Exact top-k pages by true attention mass (summed over the group's heads). Reads every
    key: an evaluation reference, not a serving algorithm."""

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        B, hq, D = q.shape
        hkv, W = page_table.shape[1:]
        ps = k_cache.shape[1]
        k = k_cache[page_table.long()].float().reshape(B, hkv, W * ps, D)
        s = torch.einsum("bhgd,bhnd->bhgn", q.float().view(B, hkv, hq // hkv, D), k) * D ** -0.5
        tok = torch.arange(W * ps, device=q.device).view(1, 1, 1, -1)
        n_tok = (num_pages.long() - 1) * ps + last_page_len.long().view(B, 1)  # [B, Hkv]
        s = s.masked_fill(tok >= n_tok.view(B, hkv, 1, 1), float("-inf"))
        p = torch.softmax(s, dim=-1).reshape(B, hkv, -1, W, ps).sum(dim=(2, 4))
        return p.masked_fill(torch.arange(W, device=q.device).view(1, 1, W)
                             >= num_pages.unsqueeze(-1), float("-inf"))
