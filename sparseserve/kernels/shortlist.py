"""Two-stage page selection for the key-code shortlist (``sparse/keycode_shortlist.py``): the
box mass of every page picks a shortlist of S pages, the key codes of the shortlisted pages
alone pick the budget. Two calls of the fused select (``kernels.select_pages``: the Triton
kernel of ``page_select``, or its torch reference) and one gather — no new kernel:

1. ``select_pages(q, kmin, kmax, page_table, ..., budget=S)``: Quest's bound on each page's
   code box (keycode2's min/max box, the ``kmin`` / ``kmax`` summaries), mass-scored over every
   full page, kept pages forced, top-S. Its output is the shortlist as a page table in block
   order with the last page last ([B, Hkv, KS] physical ids, the count, the logical blocks).
2. ``select_pages(q, kmin, kmax, shortlist, ..., budget, codes=, bits=)``: the key codes'
   approximate token attention mass of the shortlisted pages only, each head's softmax over
   the shortlisted full pages. The shortlist is in block order and holds every kept page
   (S >= sink + local + 1), so its first ``sink`` and last ``local`` entries are the kept
   pages and stage 2 keeps the same pages stage 1 kept; ties go to the lower entry, i.e. the
   lower block, in both.
3. The final logical blocks: stage 1's blocks at stage 2's entries.

Spec: ``ref.select_pages_shortlist`` (both scores of every page, box top-S, code top-K inside).

**Bytes per step** per (request, KV head), W pages, S shortlisted, page_size ps, head_dim D,
KV element size es, GQA group G: stage 1 reads the box of every full page (2·D·es) and writes
and re-reads a G × fp32 scratch row entry per page (8·G), plus the 4-byte page-table entry;
stage 2 reads, for the S shortlisted pages only, the box again and the codes (ps·D·bits/8) and
its own 8·G scratch. Llama-3-8B heads (D 128, G 4, ps 32, bf16), 128k context (W 4096), budget
64 pages, S 256: stage 1 4096 × 548 B = 2.14 MiB, stage 2 256 × 1572 B = 0.38 MiB; keycode2's
single stage reads 4096 × 1572 B = 6.1 MiB, ArkVale's 2.14 MiB, dense K+V 64 MiB.

When S covers the whole row width (S >= W) stage 1 would keep everything: the plain key-code
select runs instead (same pages). Shapes are static (S, W, budget), no host synchronisation.
"""
from __future__ import annotations

import torch

__all__ = ["select_pages_shortlist"]


def select_pages_shortlist(q, kmin, kmax, codes, page_table, num_pages, last_page_len,
                           budget_pages, shortlist_pages, sink_pages, local_pages, bits, *,
                           backend=None, num_splits=None):
    """Shortlist selection; see the module docstring and ``ref.select_pages_shortlist``.

    q [B, Hq, D], kmin/kmax [S_rows, D] (the key codes' box), codes [S_rows, page_size * D *
    bits / 32] int32, page_table [B, Hkv, W] int32, num_pages [B, Hkv] int32, last_page_len
    [B] int32 (unused), budget_pages / shortlist_pages / sink_pages / local_pages / bits: ints
    (shortlist_pages >= max(budget_pages, sink_pages + local_pages + 1)); backend: as
    ``kernels.select_pages`` (both stages); num_splits: stage 1's score programs per row.
    -> pages [B, Hkv, K] int32, num_sel [B, Hkv] int32, blocks [B, Hkv, K] int64,
    K = max(1, min(budget_pages - 1, W)) + 1, as ``select_pages`` returns them."""
    from sparseserve.kernels import resolve_backend, select_pages

    assert shortlist_pages >= max(budget_pages, sink_pages + local_pages + 1)
    W = page_table.shape[2]
    if shortlist_pages >= W:  # the shortlist is every page: key codes alone
        return select_pages(q, kmin, kmax, page_table, num_pages, last_page_len, budget_pages,
                            sink_pages, local_pages, backend=backend, codes=codes, bits=bits)
    short, n_short, short_blocks = select_pages(
        q, kmin, kmax, page_table, num_pages, last_page_len, shortlist_pages, sink_pages,
        local_pages, backend=backend, num_splits=num_splits)
    if resolve_backend(backend, q) == "torch":  # the reference lists by mass: block order
        short, short_blocks = _block_order(short, n_short, short_blocks, W)
    pages, num_sel, pos = select_pages(
        q, kmin, kmax, short, n_short, last_page_len, budget_pages, sink_pages, local_pages,
        backend=backend, codes=codes, bits=bits)
    k = max(1, min(budget_pages - 1, W)) + 1  # = stage 2's width here (W > S >= budget)
    blocks = short_blocks.gather(2, pos[..., :k])
    return pages[..., :k], num_sel, blocks


def _block_order(pages, num, blocks, W):
    """The first num - 1 entries sorted by block (the last page stays at num - 1 and the
    repeats after it)."""
    pos = torch.arange(blocks.shape[-1], device=blocks.device).view(1, 1, -1)
    key = torch.where(pos < num.long().unsqueeze(-1) - 1, blocks, W + pos)
    idx = key.argsort(dim=-1)
    return pages.gather(2, idx), blocks.gather(2, idx)
