"""Key codes read for a shortlist only: ``keycode2-sl`` (S = 4 × budget) and ``keycode2-sl2``
(S = 2 × budget).

``keycode2`` (``sparse/keycodes.py``) scores every page by the approximate attention mass of
its tokens' 2-bit key codes, so each step reads 9.4 % of the KV bytes in summaries (bf16, page
32) — more than dense attention's time budget allows at 128k (docs/results/sparse.md). Here
the same summaries are read in two stages:

1. **Shortlist by box.** Every page is scored by Quest's bound on its code box (keycode2's
   per-channel min/max, ``kmin`` / ``kmax``: 3.1 % of the KV bytes), by estimated attention
   mass (``ref.mass_from_bounds``), and the best ``S = shortlist_factor × budget`` pages are
   kept, the sink and local pages (and the last page) always among them.
2. **Choose by codes.** Only the shortlisted pages' codes are decoded; the final budget is the
   top of their approximate token attention mass, each query head's softmax over the
   shortlisted full pages (the kept pages are selected whatever their score).

Bytes per step ≈ the box of every page + box and codes of S pages (at 128k, budget 64 pages,
S 256: 2.5 MiB per request and KV head vs keycode2's 6.1 MiB, dense K+V 64 MiB; see
``kernels/shortlist.py``). ``S = max(factor × budget, sink + local + 1)``, static per
configuration (CUDA-graph-safe shapes); once S covers every page of the row the selection is
keycode2's. Summaries and ``index`` are keycode2's.

Paths: ``select`` (``fused_select``, default) is ``kernels.select_pages_shortlist`` — two
calls of the fused select kernel (Triton on CUDA, the torch reference on CPU) and a gather;
``score`` is the generic path (box bounds of every page, the shortlist, ``code_page_bounds``
of the shortlisted pages only, then ``ref.shortlist_scores``) under the base class's select.
Both equal ``ref.select_pages_shortlist``.

Measured (docs/results/fidelity.md, "Key codes for a box shortlist", 8k, 6 texts): top-1
87.4 % (f 4) / 84.0 % (f 2) at 512 tokens and 94.5 % (f 2) at 2048 vs keycode2's 91.8 / 97.6:
the box ranks the source pages of a copied passage outside the shortlist (a tighter box or a
max over the group's heads does not change that), so keycode2 stays the quality reference.
"""
from __future__ import annotations

import torch

from sparseserve.kernels import code_page_bounds, head_bounds, select_pages_shortlist
from sparseserve.kernels.ref import shortlist_mask, shortlist_scores
from sparseserve.sparse.base import Selection, SparseAlgorithm, register
from sparseserve.sparse.keycodes import KeyCode2


class KeyCodeShortlist(KeyCode2):
    """Box shortlist of ``shortlist_factor × budget`` pages, then 2-bit key codes inside it."""

    shortlist_factor = 4

    def __init__(self, page_size, budget_pages, sink_pages, local_pages):
        super().__init__(page_size, budget_pages, sink_pages, local_pages)
        self.shortlist_pages = max(self.shortlist_factor * budget_pages, budget_pages,
                                   sink_pages + local_pages + 1)

    def shortlist_box(self, summaries):
        """(lo, hi) [rows, D]: the box stage 1 bounds each page by (the codes' min / max)."""
        return summaries["kmin"], summaries["kmax"]

    def shortlist(self, box_bounds, num_pages, scale):
        """[B, Hkv, W] bool: the shortlisted pages, from per-query-head box bounds."""
        return shortlist_mask(box_bounds, num_pages, self.shortlist_pages, self.sink_pages,
                              self.local_pages, scale)

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """[B, Hkv, W]: code mass normalised over the shortlist (``ref.shortlist_scores``),
        -inf outside it; the codes of shortlisted pages only are read."""
        lo, hi = self.shortlist_box(summaries)
        scale = q.shape[-1] ** -0.5
        in_short = self.shortlist(head_bounds(q, lo, hi, page_table, num_pages), num_pages,
                                  scale)
        code = self.shortlisted_code_bounds(q, page_table, in_short, summaries)
        return self.from_code_bounds(code, in_short, num_pages, scale)

    def from_code_bounds(self, code_bounds, in_short, num_pages, scale):
        """Page scores [B, Hkv, W] from per-head code bounds (valid on the shortlist) and the
        shortlist: ``ref.shortlist_scores``. Evaluation variants override this alone."""
        return shortlist_scores(code_bounds, in_short, num_pages, self.sink_pages,
                                self.local_pages, scale)

    def shortlisted_code_bounds(self, q, page_table, in_short, summaries):
        """[B, Hkv, G, W] ``code_page_bounds`` of the shortlisted pages (their codes alone are
        read: a [B, Hkv, min(S, W)] table of them in block order), -inf elsewhere."""
        B, hkv, W = page_table.shape
        width = min(self.shortlist_pages, W)  # a row's shortlist never holds more
        blk = torch.arange(W, device=page_table.device).view(1, 1, W)
        key, idx = torch.where(in_short, blk, W + blk).sort(dim=-1)
        key, idx = key[..., :width], idx[..., :width]
        ok = key < W
        sub = page_table.gather(2, idx)
        c = code_page_bounds(q, summaries["kmin"], summaries["kmax"], summaries["codes"], sub,
                             ok.sum(-1).to(torch.int32), self.bits)            # [B, Hkv, G, width]
        G = c.shape[2]
        out = torch.full((B, hkv, G, W + 1), float("-inf"), device=c.device)
        at = torch.where(ok, idx, W).unsqueeze(2).expand(B, hkv, G, width)
        return out.scatter_(3, at, c)[..., :W]

    def select(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """Two fused select calls (``kernels.select_pages_shortlist``): the same set of pages
        as the generic select over score()."""
        cls = type(self)
        if not self.fused_select or cls.score is not KeyCodeShortlist.score \
                or cls.shortlist is not KeyCodeShortlist.shortlist \
                or cls.shortlist_box is not KeyCodeShortlist.shortlist_box \
                or cls.from_code_bounds is not KeyCodeShortlist.from_code_bounds:
            return SparseAlgorithm.select(self, q, page_table, num_pages, last_page_len,
                                          summaries, k_cache)
        pages, num_sel, blocks = select_pages_shortlist(
            q, summaries["kmin"], summaries["kmax"], summaries["codes"], page_table, num_pages,
            last_page_len, self.budget_pages, self.shortlist_pages, self.sink_pages,
            self.local_pages, self.bits)
        return Selection(pages, num_sel, last_page_len, blocks)


@register("keycode2-sl")
class KeyCode2Shortlist(KeyCodeShortlist):
    """keycode2's codes read for a box shortlist of 4 × the budget."""

    shortlist_factor = 4


@register("keycode2-sl2")
class KeyCode2Shortlist2(KeyCodeShortlist):
    """keycode2's codes read for a box shortlist of 2 × the budget."""

    shortlist_factor = 2
