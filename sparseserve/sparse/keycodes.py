"""Token-level key codes: a few bits per channel per token, inside the page's box.

The page's box (``kmin``, ``kmax`` per channel, as Quest/ArkVale keep) becomes the range of a
``bits``-bit code per channel of every token of the page: token t's key is approximated by
``k^_tc = kmin_c + (kmax_c - kmin_c) * level(code_tc)``. Pages are then scored by the
estimated attention mass of their *tokens* — per query head a softmax over the approximate
logits ``q · k^_t`` of every token of the row's full pages, summed over the page's tokens and
the GQA group's heads — so the score is the exact top-k oracle's, with approximate keys in
place of the keys (the page's log-sum-exp of its tokens' approximate logits goes through
``ref.mass_from_bounds``, whose softmax over pages of per-page log-sum-exps is the token
softmax summed per page). A box bound can only say "some key of this page might point along
q"; the codes say which key does.

* ``keycode1`` — 1 bit: the box is ArkVale's around the keys' mean, ``mean -/+ r`` with
  ``r = mean_t |k_t - mean|`` per channel, and the bit says which side of the mean the key
  lies (``k^ = mean + r`` or ``mean - r``: each token is a corner of ArkVale's cuboid).
* ``keycode2`` — 2 bits: the box is the min/max box, levels ``(i + 0.5) / 4`` of its width.

Summaries per page: ``kmin``, ``kmax`` ([D] each, KV dtype) and ``codes`` (int32 words holding
``page_size * D * bits`` bits, token-major). Bytes at page 32, D 64, bf16 KV: 256 + 256 B
(1 bit) / 512 + 256 B (2 bits) per page per KV head vs 8 KiB of KV: 6.25 % / 9.4 % of the KV
bytes (Quest/ArkVale's boxes: 3.1 %, 8-token boxes: 12.5 %).

Selection cost: the select reads the codes (1/16 or 1/8 of the K bytes at bf16) and does a
dot product per token, like dense attention over 1-2-bit keys. ``select`` is Quest's fused
kernel (``kernels.select_pages(..., codes=, bits=)``: the score phase decodes each tile of
pages' approximate keys and reduces their logits per page, the mass normalisation, threshold
search and compaction are shared); ``score`` (the generic path) uses
``kernels/code_scores.py``. Both have ``ref.code_page_bounds`` as their spec.
"""
from __future__ import annotations

import os

import torch

from sparseserve.kernels import code_page_bounds, select_pages
from sparseserve.kernels.ref import mass_from_bounds
from sparseserve.sparse.base import Selection, SparseAlgorithm, register


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, F] integer codes in [0, 2**bits) -> [N, F * bits // 32] int32 words (code f at bits
    (f * bits) % 32 of word (f * bits) // 32)."""
    n, f = codes.shape
    per = 32 // bits
    c = codes.to(torch.int64).view(n, f // per, per)
    shift = (torch.arange(per, device=codes.device) * bits).view(1, 1, per)
    words = (c << shift).sum(-1)  # < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: [..., nw] int32 -> [..., nw * 32 // bits] int64 codes."""
    per = 32 // bits
    shift = (torch.arange(per, device=words.device) * bits)
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w.unsqueeze(-1) >> shift) & ((1 << bits) - 1)).flatten(-2)


class KeyCodes(SparseAlgorithm):
    summary_names = ("kmin", "kmax", "codes")
    bits = 1
    fused_select = os.environ.get("SPARSESERVE_FUSED_SELECT", "1") not in ("0", "")

    def summary_shapes(self, head_dim):
        nw = self.page_size * head_dim * self.bits // 32
        assert nw * 32 == self.page_size * head_dim * self.bits, "page codes must fill words"
        return {"kmin": (head_dim,), "kmax": (head_dim,), "codes": (nw,)}

    def summary_dtypes(self):
        return {"codes": torch.int32}

    def index(self, k_cache, page_ids, num_tokens, summaries, queries):
        kmin, kmax, codes = summaries["kmin"], summaries["kmax"], summaries["codes"]
        live = page_ids >= 0
        rows = torch.where(live, page_ids, kmin.shape[0] - 1).long()  # masked -> scratch
        k = k_cache[torch.where(live, page_ids, 0).long()].float()   # [N, ps, D]
        n, ps, d = k.shape
        ok = (torch.arange(ps, device=k.device).view(1, -1, 1) < num_tokens.view(-1, 1, 1))
        cnt = num_tokens.clamp(min=1).view(-1, 1).float()
        if self.bits == 1:
            c = torch.where(ok, k, 0.0).sum(1) / cnt                  # mean key [N, D]
            r = torch.where(ok, (k - c.unsqueeze(1)).abs(), 0.0).sum(1) / cnt
            lo, hi = c - r, c + r
            code = (k >= c.unsqueeze(1)).to(torch.int64)
        else:
            lo = torch.where(ok, k, float("inf")).amin(1)
            hi = torch.where(ok, k, float("-inf")).amax(1)
            width = (hi - lo).clamp(min=1e-30).unsqueeze(1)
            levels = 1 << self.bits
            code = ((k - lo.unsqueeze(1)) / width * levels).floor().clamp(0, levels - 1)
            code = code.to(torch.int64)
        code = torch.where(ok, code, 0)
        kmin[rows] = lo.to(kmin.dtype)
        kmax[rows] = hi.to(kmax.dtype)
        codes[rows] = pack_codes(code.reshape(n, ps * d), self.bits)

    def levels(self, codes: torch.Tensor) -> torch.Tensor:
        """Fraction of the box width of each code."""
        if self.bits == 1:
            return codes.float()
        return (codes.float() + 0.5) / (1 << self.bits)

    def approx_keys(self, summaries, rows: torch.Tensor) -> torch.Tensor:
        """[*rows.shape, page_size, D] float32 approximate keys of the pages at ``rows``."""
        lo = summaries["kmin"][rows].float()                           # [..., D]
        hi = summaries["kmax"][rows].float()
        lev = self.levels(unpack_codes(summaries["codes"][rows], self.bits))
        d = lo.shape[-1]
        lev = lev.view(*rows.shape, self.page_size, d)
        return lo.unsqueeze(-2) + (hi - lo).unsqueeze(-2) * lev

    def from_token_logits(self, x: torch.Tensor, num_pages: torch.Tensor, scale: float):
        """Page scores [B, Hkv, W] from scaled approximate logits [B, Hkv, G, W, ps]."""
        w = x.shape[3]
        lse = torch.logsumexp(x, dim=-1) / scale  # per page, in bound units
        past = torch.arange(w, device=x.device).view(1, 1, 1, w) >= num_pages.long().view(
            *num_pages.shape, 1, 1)
        return mass_from_bounds(lse.masked_fill(past, float("-inf")), num_pages,
                                self.sink_pages, self.local_pages, scale)

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """[B, Hkv, W]: approximate token attention mass per page (kernels.code_page_bounds,
        then ref.mass_from_bounds); +inf kept / last page, -inf past num_pages."""
        u = code_page_bounds(q, summaries["kmin"], summaries["kmax"], summaries["codes"],
                             page_table, num_pages, self.bits)
        return mass_from_bounds(u, num_pages, self.sink_pages, self.local_pages,
                                q.shape[-1] ** -0.5)

    def select(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """One fused kernel (kernels.select_pages with codes): the same set of pages as the
        generic select over score()."""
        if not self.fused_select or type(self).score is not KeyCodes.score:
            return super().select(q, page_table, num_pages, last_page_len, summaries, k_cache)
        pages, num_sel, blocks = select_pages(
            q, summaries["kmin"], summaries["kmax"], page_table, num_pages, last_page_len,
            self.budget_pages, self.sink_pages, self.local_pages, codes=summaries["codes"],
            bits=self.bits)
        return Selection(pages, num_sel, last_page_len, blocks)


@register("keycode1")
class KeyCode1(KeyCodes):
    """1 bit per channel per token around the page's mean key (ArkVale's cuboid corners)."""

    bits = 1


@register("keycode2")
class KeyCode2(KeyCodes):
    """2 bits per channel per token inside the page's min/max box."""

    bits = 2
