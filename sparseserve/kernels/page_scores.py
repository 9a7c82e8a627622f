"""Page upper bounds from per-page summaries: the scoring half of the generic ``select`` (top-k
follows with ``torch.topk``; the fused ``page_select`` kernel is the engine's fast path).

Grid (B, Hkv, cdiv(W, BLOCK_W)): each program loads the G query heads of one KV-head group and a
``[BLOCK_W, D]`` tile of summary rows (gathered through the page table), and either sums the
per-head upper bounds over the group (the raw-sum scoring, kept as an evaluation variant) or
writes each head's bound (``per_head``: the input of Quest/ArkVale's mass scoring,
``ref.mass_from_bounds``). Entries past ``num_pages`` get -inf and read nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["score_pages", "SCORE_MODES"]

SCORE_MODES = ("quest", "arkvale")


@triton.jit
def _score_pages_kernel(
    q_ptr, kmin_ptr, kmax_ptr, krad_ptr, pt_ptr, np_ptr, s_ptr,
    stride_qb, stride_qh, stride_min, stride_max, stride_rad,
    stride_ptb, stride_pth, stride_npb, stride_sb, stride_sh, stride_sg,
    W,
    G: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    ARKVALE: tl.constexpr, PER_HEAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    wb = tl.program_id(2)
    offs_w = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    b64 = b.to(tl.int64)
    n = tl.load(np_ptr + b * stride_npb + h)
    w_ok = (offs_w < n) & (offs_w < W)
    page = tl.load(pt_ptr + b64 * stride_ptb + h * stride_pth + offs_w, mask=w_ok, other=0)
    page = page.to(tl.int64)
    mask = w_ok[:, None] & d_ok[None, :]
    hi = tl.load(kmax_ptr + page[:, None] * stride_max + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)                                  # [BLOCK_W, BLOCK_D]
    lo = tl.load(kmin_ptr + page[:, None] * stride_min + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)                                  # [BLOCK_W, BLOCK_D]
    if ARKVALE:
        r = tl.load(krad_ptr + page[:, None] * stride_rad + offs_d[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        c = (hi + lo) * 0.5
        hi = c + r
        lo = c - r
    s_row = s_ptr + b64 * stride_sb + h * stride_sh + offs_w
    score = tl.zeros([BLOCK_W], tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + b64 * stride_qb + (h * G + g) * stride_qh + offs_d, mask=d_ok,
                     other=0.0).to(tl.float32)                              # [BLOCK_D]
        sg = tl.sum(tl.maximum(qg[None, :] * hi, qg[None, :] * lo), axis=1)  # [BLOCK_W]
        if PER_HEAD:
            tl.store(s_row + g * stride_sg, tl.where(w_ok, sg, float("-inf")), mask=offs_w < W)
        else:
            score += sg
    if not PER_HEAD:
        score = tl.where(w_ok, score, float("-inf"))
        tl.store(s_row, score, mask=offs_w < W)


def score_pages(q, kmin, kmax, kradius, page_table, num_pages, mode, out=None, per_head=False):
    """Upper-bound scores of candidate pages from their summaries.

    Args:
        q:          [B, Hq, D]          decode queries, Hq = Hkv * G (last dim contiguous)
        kmin, kmax: [S, D]              per-page channel min / max (summary rows; last dim
                                        contiguous)
        kradius:    [S, D] or None      ArkVale radius (required for mode "arkvale")
        page_table: [B, Hkv, W] int32   candidate pages (summary rows); entries >= num_pages ignored
        num_pages:  [B, Hkv] int32      valid entries of page_table[b, h]
        mode:       "quest"   score = sum_g sum_c max(q_gc * M_c, q_gc * m_c)
                    "arkvale" with c = (M + m) / 2, r = kradius:
                              score = sum_g sum_c max(q_gc * (c + r)_c, q_gc * (c - r)_c)
        out:        [B, Hkv, W] float32 or None (written in place if given);
                    [B, Hkv, G, W] with per_head
        per_head:   write each query head's bound instead of the sum over the group
    Returns:
        scores: [B, Hkv, W] float32 (per_head: [B, Hkv, G, W]); entries w >= num_pages[b, h]
        are -inf.
    """
    if mode not in SCORE_MODES:
        raise ValueError(f"unknown score mode {mode!r}; expected one of {SCORE_MODES}")
    arkvale = mode == "arkvale"
    if arkvale and kradius is None:
        raise ValueError("mode 'arkvale' needs kradius")
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    assert Hq % Hkv == 0
    assert q.stride(2) == 1 and kmin.stride(1) == 1 and kmax.stride(1) == 1
    assert page_table.stride(2) == 1 and num_pages.stride(1) == 1
    krad = kradius if arkvale else kmin
    assert krad.stride(1) == 1
    G = Hq // Hkv
    shape = (B, Hkv, G, W) if per_head else (B, Hkv, W)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    assert out.shape == shape and out.dtype == torch.float32 and out.stride(-1) == 1
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_W = max(16, min(64, 4096 // BLOCK_D))
    grid = (B, Hkv, triton.cdiv(W, BLOCK_W))
    _score_pages_kernel[grid](
        q, kmin, kmax, krad, page_table, num_pages, out,
        q.stride(0), q.stride(1), kmin.stride(0), kmax.stride(0), krad.stride(0),
        page_table.stride(0), page_table.stride(1), num_pages.stride(0),
        out.stride(0), out.stride(1), out.stride(2) if per_head else 0, W,
        G=G, D=D, BLOCK_W=BLOCK_W, BLOCK_D=BLOCK_D, ARKVALE=arkvale, PER_HEAD=per_head,
        num_warps=4)
    return out
