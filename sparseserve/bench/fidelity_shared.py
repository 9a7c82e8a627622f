"""Exact attention math for decode rows that all read one text (the teacher-forced tail).

In ``TailHarness`` every row's page table lists the same physical pages (page id =
``block * Hkv + head``), so one ``q · K`` product against the text's keys serves every row,
instead of the CPU reference kernels gathering the whole context once per row. It gives:

* ``page_mass``  — true attention mass of each page for each (row, KV head), summed over the
  group's query heads, causally masked at the row's position: what ``oracle`` selects by and
  what the recall metric measures with;
* ``attend``     — a drop-in for ``paged_decode_attention`` (same contract) that evaluates the
  same softmax over the same selected tokens from the shared product (fast mode; tests check
  it equals the engine kernel);
* ``SharedOracle`` — ``oracle`` scoring from ``page_mass`` (same scores as ``Oracle.score``);
* ``shared_bounds_class`` — Quest/ArkVale scoring from one summary read for all rows.

The cached product is keyed by layer and checked against the query, so a stale entry can
never be used.
"""
from __future__ import annotations


import torch

from sparseserve.sparse.algorithms import Oracle
from sparseserve.sparse.base import SparseAlgorithm


class SharedText:
    def __init__(self, kv, num_kv_heads: int, num_tokens: int, scale: float,
                 base: int = 0) -> None:
        self.kv = kv
        self.base = base  # the text's first page (page id = base + block * Hkv + head)
        self.hkv = num_kv_heads
        self.ps = kv.page_size
        self.nb = -(-num_tokens // self.ps)
        self.num_tokens = num_tokens
        self.scale = scale
        self.layer_of = {t.data_ptr(): i for i, t in enumerate(kv.k)}
        self.seq_lens: torch.Tensor | None = None  # [B] tokens each row attends (position + 1)
        self._cache: tuple | None = None  # (layer, q, scores, probs)

    def page_rows(self, w: int) -> torch.Tensor:
        """[Hkv, w] the summary rows (page ids) of the text's first w pages per KV head."""
        return self.base + torch.arange(w).view(1, w) * self.hkv + torch.arange(self.hkv).view(-1, 1)

    def set_rows(self, seq_lens: torch.Tensor) -> None:
        self.seq_lens = seq_lens.long()
        self._cache = None

    @property
    def written(self) -> int:
        """Tokens of the text stored when the current rows attend: those before the furthest
        row's position (each row stores its own K/V before attention), at most the text."""
        if self.seq_lens is None or self.seq_lens.numel() == 0:
            return self.num_tokens
        return min(self.num_tokens, int(self.seq_lens.max()))

    def _text(self, cache: torch.Tensor) -> torch.Tensor:
        """[Hkv, nb * ps, D] fp32: the text's K or V in token order, zeros past the last token
        the current rows attend (slots not written yet hold whatever the allocator left — NaN
        at times — and a masked logit's zero weight times NaN in V would still be NaN). Not
        only the last page's tail: in the first pass over a text, a chunk's rows run before
        the later chunks' tail tokens are stored (the CPU KV cache is torch.empty, so their
        slots hold a freed tensor's bytes when an earlier test left NaN in the heap)."""
        d = cache.shape[-1]
        pages = cache[self.base:self.base + self.nb * self.hkv].view(self.nb, self.hkv, self.ps, d)
        text = pages.transpose(0, 1).reshape(self.hkv, self.nb * self.ps, d).float()
        tok = torch.arange(self.nb * self.ps, device=text.device).view(1, -1, 1)
        return torch.where(tok < self.written, text, 0.0)

    def _scores(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale * q·K [B, Hkv, G, N], causal softmax of it), cached per layer and query."""
        c = self._cache
        if c is not None and c[0] == layer and c[1].shape == q.shape and torch.equal(c[1], q):
            return c[2], c[3]
        b, hq, d = q.shape
        kt = self._text(self.kv.k[layer])
        s = torch.einsum("bhgd,hnd->bhgn", q.float().view(b, self.hkv, hq // self.hkv, d),
                         kt) * self.scale
        tok = torch.arange(s.shape[-1], device=q.device)
        s = s.masked_fill(tok.view(1, 1, 1, -1) >= self.seq_lens.view(-1, 1, 1, 1),
                          float("-inf"))
        p = torch.softmax(s, dim=-1)
        self._cache = (layer, q.clone(), s, p)
        return s, p

    def page_mass(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, nb] attention mass per page, summed over the group's query heads."""
        _, p = self._scores(layer, q)
        b, h, g, n = p.shape
        return p.view(b, h, g, self.nb, self.ps).sum(dim=(2, 4))

    def covers(self, page_table: torch.Tensor, num_pages: torch.Tensor) -> bool:
        """True when every valid entry is a page of the text of its own KV head."""
        if self.seq_lens is None or page_table.shape[0] != self.seq_lens.shape[0]:
            return False
        w = page_table.shape[2]
        valid = torch.arange(w).view(1, 1, w) < num_pages.long().unsqueeze(-1)
        pt = page_table.long() - self.base
        head_ok = (pt % self.hkv) == torch.arange(self.hkv).view(1, -1, 1)
        return bool(((head_ok & (pt < self.nb * self.hkv) & (pt >= 0)) | ~valid).all())

    def _attended_logits(self, layer, q, page_table, num_pages, last_page_len):
        """[B, Hkv, G, N] the shared scaled logits, -inf outside the attended tokens."""
        b = q.shape[0]
        w = page_table.shape[2]
        s, _ = self._scores(layer, q)
        valid = torch.arange(w).view(1, 1, w) < num_pages.long().unsqueeze(-1)
        # [B, Hkv, W] block of each entry (masked entries -> the dropped extra block nb)
        blocks = torch.where(valid, (page_table.long() - self.base) // self.hkv, self.nb)
        sel = torch.zeros((b, self.hkv, self.nb + 1), dtype=torch.bool)
        sel.scatter_(2, blocks, True)
        last_block = blocks.gather(2, (num_pages.long() - 1).clamp(min=0).unsqueeze(-1))
        seq_len = last_block * self.ps + last_page_len.long().view(-1, 1, 1)  # [B, Hkv, 1]
        tok = torch.arange(self.nb * self.ps).view(1, 1, -1)
        mask = sel[..., :self.nb].repeat_interleave(self.ps, dim=2) & (tok < seq_len)
        return s.masked_fill(~mask.unsqueeze(2), float("-inf"))

    def attend(self, q, k_cache, v_cache, page_table, num_pages, last_page_len, scale,
               out=None, fallback=None):
        """paged_decode_attention's contract, computed from the shared q·K product."""
        layer = self.layer_of.get(k_cache.data_ptr())
        if layer is None or scale != self.scale or not self.covers(page_table, num_pages):
            return fallback(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale,
                            out)
        b, hq, d = q.shape
        s = self._attended_logits(layer, q, page_table, num_pages, last_page_len)
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("bhgn,hnd->bhgd", p, self._text(v_cache)).reshape(b, hq, d)
        o = o.to(q.dtype)
        if out is None:
            return o
        out.copy_(o)
        return out

    def attend_lse(self, q, k_cache, page_table, num_pages, last_page_len, scale,
                   fallback=None):
        """paged_decode_lse's contract ([B, Hq] log-sum-exp of the attended logits), from
        the shared q·K product."""
        layer = self.layer_of.get(k_cache.data_ptr())
        if layer is None or scale != self.scale or not self.covers(page_table, num_pages):
            return fallback(q, k_cache, page_table, num_pages, last_page_len, scale)
        s = self._attended_logits(layer, q, page_table, num_pages, last_page_len)
        return torch.logsumexp(s, dim=-1).reshape(q.shape[0], q.shape[1])


class SharedOracle(Oracle):
    """``oracle`` with its scores (true attention mass per page) from a SharedText."""

    shared: SharedText | None = None

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        sh = self.shared
        layer = sh.layer_of.get(k_cache.data_ptr())
        if layer is None or not sh.covers(page_table, num_pages):
            return super().score(q, page_table, num_pages, last_page_len, summaries, k_cache)
        w = page_table.shape[2]
        mass = sh.page_mass(layer, q)[:, :, :w]
        blocks = (page_table.long() - sh.base) // sh.hkv  # the text's pages, in block order
        mass = mass.gather(2, blocks.clamp(max=sh.nb - 1))
        return mass.masked_fill(torch.arange(w).view(1, 1, w) >= num_pages.unsqueeze(-1),
                                float("-inf"))


class _GivenScores(SparseAlgorithm):
    """select() over scores computed elsewhere (the oracle selection for recall)."""

    given: torch.Tensor

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        return self.given


class RecallMeter:
    """on_select hook: attention-mass recall of each selection vs the exact top-k selection
    (same budget and always-kept pages), and the mass it captures, per sparse layer."""

    def __init__(self, shared: SharedText, page_size: int, budget_pages: int, sink: int,
                 local: int) -> None:
        self.shared = shared
        self.best = _GivenScores(page_size, budget_pages, sink, local)
        self.recall_sum: dict[int, float] = {}
        self.mass_sum: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def __call__(self, layer, q, sel, ctx) -> None:
        pt = ctx.dec_page_table
        w = pt.shape[2]
        g = q.shape[1] // pt.shape[1]
        mass = self.shared.page_mass(layer, q)[:, :, :w]  # [B, Hkv, W] (rows share pages)
        blk = torch.arange(w).view(1, 1, w)
        self.best.given = mass.masked_fill(blk >= ctx.dec_num_pages.unsqueeze(-1),
                                           float("-inf"))
        ref = self.best.select(q, pt, ctx.dec_num_pages, ctx.dec_last_len, None, None)
        got = _selected_mass(mass, sel)
        best = _selected_mass(mass, ref)
        recall = (got / best.clamp(min=1e-30)).clamp(max=1.0)
        self.recall_sum[layer] = self.recall_sum.get(layer, 0.0) + float(recall.sum())
        self.mass_sum[layer] = self.mass_sum.get(layer, 0.0) + float((got / g).sum())
        self.count[layer] = self.count.get(layer, 0) + recall.numel()

    def summary(self) -> dict:
        n = sum(self.count.values())
        if not n:
            return {"recall": None, "mass": None, "recall_by_layer": {}}
        return {"recall": sum(self.recall_sum.values()) / n,
                "mass": sum(self.mass_sum.values()) / n,
                "recall_by_layer": {layer: self.recall_sum[layer] / self.count[layer]
                                    for layer in sorted(self.count)}}


def _selected_mass(mass: torch.Tensor, sel) -> torch.Tensor:
    """[B, Hkv] mass of the selected blocks (entries < num_pages)."""
    k = sel.blocks.shape[2]
    ok = torch.arange(k).view(1, 1, k) < sel.num_pages.long().unsqueeze(-1)
    return (mass.gather(2, sel.blocks.long().clamp(max=mass.shape[2] - 1)) * ok).sum(-1)


def fast_decode_attention(shared: SharedText):
    """A decode attention for `ModelRunner.hooked(decode_attention=...)`: shared.attend for rows
    of the shared text, the engine kernel for anything else."""
    from sparseserve.kernels import paged_decode_attention as engine_kernel
    from sparseserve.kernels import ref

    def attend(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale, out=None,
               **kw):
        if kw:
            return engine_kernel(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale,
                                 out, **kw)
        return shared.attend(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale,
                             out, fallback=engine_kernel)

    def lse(q, k_cache, page_table, num_pages, last_page_len, scale):
        return shared.attend_lse(q, k_cache, page_table, num_pages, last_page_len, scale,
                                 fallback=ref.paged_decode_lse)

    attend.lse = lse  # the exact part's log-sum-exp, for an estimating algorithm's merge
    return attend


def bound_scores(sh: SharedText, q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 w: int, n_sub: int = 1, per_box: bool = False) -> torch.Tensor:
    """Quest's per-query-head bound sum_c max(q_c hi_c, q_c lo_c) for the text's first w pages,
    computed as q+ · hi + q- · lo (equal, since hi >= lo): [B, Hkv, G, w]. With n_sub boxes
    per page row (hi, lo [S, n_sub * D]) the page's bound is the max of its boxes' (per_box:
    [B, Hkv, G, w, n_sub], each box's)."""
    b, hq, d = q.shape
    rows = sh.page_rows(w)
    hi_t = hi[rows].float().view(sh.hkv, w, n_sub, d)  # [Hkv, w, n, D]
    lo_t = lo[rows].float().view(sh.hkv, w, n_sub, d)
    qg = q.float().view(b, sh.hkv, hq // sh.hkv, d)
    u = (torch.einsum("bhgd,hwjd->bhgwj", qg.clamp(min=0), hi_t)
         + torch.einsum("bhgd,hwjd->bhgwj", qg.clamp(max=0), lo_t))
    return u if per_box else u.amax(dim=-1)


def shared_bounds_class(cls):
    """A subclass of a min/max-summary algorithm (quest, arkvale, their sub-page box variants
    or a scoring variant) whose score reads the text's summaries once for all rows (fast mode)
    and turns the per-head bounds into scores with the algorithm's own ``from_bounds`` (or
    ``from_box_bounds``, per-box bounds, where a variant defines it); its index() is the
    original's."""

    class SharedBounds(cls):
        shared: SharedText | None = None
        fused_select = False  # the generic select, over score() below

        def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
            sh = self.shared
            if sh is None or not sh.covers(page_table, num_pages):
                return super().score(q, page_table, num_pages, last_page_len, summaries,
                                     k_cache)
            w = page_table.shape[2]
            per_box = hasattr(self, "from_box_bounds")
            u = bound_scores(sh, q, summaries["kmin"], summaries["kmax"], w, self.n_sub,
                             per_box)
            past = torch.arange(w).view(1, 1, 1, w) >= num_pages.unsqueeze(-1).unsqueeze(-1)
            if per_box:
                return self.from_box_bounds(u.masked_fill(past.unsqueeze(-1), float("-inf")),
                                            num_pages, q.shape[-1] ** -0.5)
            u = u.masked_fill(past, float("-inf"))  # head_bounds' contract
            return self.from_bounds(u, num_pages, q.shape[-1] ** -0.5)

    SharedBounds.__name__ = f"Shared{cls.__name__}"
    return SharedBounds


def shared_codes_class(cls):
    """A key-code algorithm (sparse/keycodes.py) whose score decodes the text's approximate
    keys once for all rows (fast mode); same math as its own score()."""

    class SharedCodes(cls):
        shared: SharedText | None = None

        def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
            sh = self.shared
            if sh is None or not sh.covers(page_table, num_pages):
                return super().score(q, page_table, num_pages, last_page_len, summaries,
                                     k_cache)
            b, hq, d = q.shape
            w = page_table.shape[2]
            rows = sh.page_rows(w)
            kh = self.approx_keys(summaries, rows)  # [Hkv, w, ps, D]
            scale = d ** -0.5
            x = torch.einsum("bhgd,hwtd->bhgwt", q.float().view(b, sh.hkv, hq // sh.hkv, d),
                             kh) * scale
            return self.from_token_logits(x, num_pages, scale)

    SharedCodes.__name__ = f"Shared{cls.__name__}"
    return SharedCodes


def shared_shortlist_class(cls):
    """A key-code shortlist algorithm (sparse/keycode_shortlist.py) scored from the shared text
    (fast mode): the box bounds of every page from one summary read for all rows, the
    shortlist by the algorithm's own ``shortlist``, the code bounds from one decode of the
    text's approximate keys, then its ``from_code_bounds`` (``ref.shortlist_scores``) — its
    score()'s math (that one decodes only the shortlisted pages; the scores outside the
    shortlist are masked)."""
    class SharedShortlist(cls):
        shared: SharedText | None = None
        fused_select = False  # the generic select, over score() below

        def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
            sh = self.shared
            if sh is None or not sh.covers(page_table, num_pages):
                return super().score(q, page_table, num_pages, last_page_len, summaries,
                                     k_cache)
            b, hq, d = q.shape
            w = page_table.shape[2]
            scale = d ** -0.5
            past = torch.arange(w).view(1, 1, 1, w) >= num_pages.unsqueeze(-1).unsqueeze(-1)
            box = bound_scores(sh, q, *self.shortlist_box(summaries), w)
            in_short = self.shortlist(box.masked_fill(past, float("-inf")), num_pages, scale)
            rows = sh.page_rows(w)
            kh = self.approx_keys(summaries, rows)  # [Hkv, w, ps, D]
            x = torch.einsum("bhgd,hwtd->bhgwt", q.float().view(b, sh.hkv, hq // sh.hkv, d),
                             kh) * scale
            code = (torch.logsumexp(x, dim=-1) / scale).masked_fill(past, float("-inf"))
            return self.from_code_bounds(code, in_short, num_pages, scale)

    SharedShortlist.__name__ = f"Shared{cls.__name__}"
    return SharedShortlist
