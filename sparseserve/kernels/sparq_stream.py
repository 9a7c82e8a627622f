"""A streaming score phase for ``keycode2-sparq``'s fused select (``select_pages(...,
sparq_kernel=3)``, ``keycode2-sparq@score_kernel=3``): the arithmetic of ``sparq_tiles`` in a
loop that keeps every page's numbers in registers. Spec: ``ref.sparq_page_bounds``.

Why. ``sparq_tiles`` measured 375 µs per layer at 128k x 16 on the H200 (sparse.md, twentieth
session), 13 % of copy bandwidth on its bytes: latency-bound. Per chunk of 64 pages it waits
on a chain of global accesses — the page ids, then the means and box words (page terms), a
store of the page terms to the score row, a barrier, then per sub-tile of 16 pages the page
ids again, the page terms read back, and the records — about six round trips of memory
latency per 64 pages, with 12 warps per SM to hide them.

Here one iteration is one sub-tile of 16 pages (page ``k * NW + w`` on warp ``w``, as in
``sparq_tiles``): the page ids, then everything else the sub-tile needs in one batch of
independent loads — the int8 means and scales, the means at the row's channels and the whole
records (whose box words give the page terms, so no separate box load) — then the page-term
dots (16 rows), the decoded tokens' dot, and one store of the page's ``x``. Two levels of
dependent loads per 16 pages, no explicit barrier, no read-back; the loop is a ``tl.range``
with ``num_stages`` and Triton's pipeliner double-buffers it (the next sub-tile's loads go to
shared memory by async copies while this one computes). The compiled loop still has 7
``BAR.SYNC`` per iteration (those copies' waits, the dots' operand and the reductions' layout
conversions through shared memory; offline SASS, sparse.md). Fewer live registers
(16-row tiles instead of 64: 128 instead of 143, offline ptxas) leave room for 4 programs of
4 warps per SM instead of 3; the split heuristic gives this version 12 programs per SM
(``page_select.STREAM_PROGRAMS_PER_SM``).

Measured (H100, 128k x 16, Llama-3-8B heads, the score launch alone, torch.profiler): 258 µs
at 12 splits against ``sparq_tiles``' 359 µs at its 3 (and 380-395 µs at 6-24: its registers
cap it at 12 warps per SM whatever the grid); a hand-written software pipeline on top (the
next sub-tile's gathers issued before this one's arithmetic, 126 registers under maxnreg)
measured 247-252 µs, within noise, and was not kept (the pipeliner already does it). At
~743 SASS instructions per warp per 16 pages the launch issues at ~41 % of the H100's rate;
the barriers are the next suspect, to be confirmed by Nsight Compute (sparse.md).

Same numbers as ``sparq_tiles`` up to the page-term dot's summation order (a 16-row instead of
a 64-row dot): scores agree to fp32 rounding, the pages chosen are the same away from ties.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import patch_triton_interpreter
from .sparq_tiles import row_queries, subtile_words, subtile_x

patch_triton_interpreter()

__all__ = ["sparq_score_stream", "STREAM_PAGES"]

STREAM_PAGES = 16  # pages per iteration (= block_w of this version)


@triton.jit
def sparq_score_stream(q_row, stride_qh, mean_ptr, lo_ptr, hi_ptr, codes_ptr, kscale_ptr, ch_row,
                       stride_mean, stride_lo, stride_hi, stride_codes, pt_row, s_row, stride_sg,
                       n, c0, c1, qk_scale, magic,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, PS: tl.constexpr, R: tl.constexpr,
                       SUB: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr,
                       FAST: tl.constexpr, DOT_PREC: tl.constexpr, BCS: tl.constexpr,
                       CCS: tl.constexpr, REC: tl.constexpr, STAGES: tl.constexpr,
                       RI: tl.constexpr = 1):
    """``sparq_tiles.sparq_score_tiles``' contract with chunks of ``SUB`` pages: writes
    ``s_row[g, page]`` for the full pages of chunks ``c0 .. c1`` and returns the row's
    (max, sum of exp2(x - max)) per head [GP]."""
    DT = lo_ptr.dtype.element_ty
    NWC: tl.constexpr = PS // 16  # code words per channel and page
    K: tl.constexpr = SUB // NW
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    d_ok = offs_d < D
    qt, qc, qbd, ch = row_queries(q_row, stride_qh, ch_row, qk_scale, DT, G, GP, D, BLOCK_D, R,
                                  NWC)
    m_acc = tl.full([K, NW, GP], -1e30, tl.float32)  # per (page slot, head): running max
    l_acc = tl.zeros([K, NW, GP], tl.float32)        # and sum of exp2(x - max)
    for c in tl.range(c0, c1, num_stages=STAGES):
        offs_s = c * SUB + tl.arange(0, SUB)          # page k * NW + w is entry k * NW + w
        ok = offs_s < n - 1  # full pages
        page = tl.load(pt_row + offs_s, mask=ok, other=0).to(tl.int64)           # [SUB]
        pg2 = tl.reshape(page, (K, NW))
        m3 = tl.reshape(ok, (K, NW))[:, :, None]
        # one batch of independent loads: means, scales, the channels' means, the records
        ks = tl.load(kscale_ptr + page, mask=ok, other=0.0)
        mean = tl.load(mean_ptr + page[:, None] * stride_mean + offs_d[None, :],
                       mask=ok[:, None] & d_ok[None, :], other=0)                # [SUB, BLOCK_D]
        mc = tl.load(mean_ptr + page[:, None] * stride_mean + ch[None, :], mask=ok[:, None],
                     other=0)                                                     # [SUB, R]
        lo3, hi3, w0, w1, wp = subtile_words(
            codes_ptr, lo_ptr, hi_ptr, pg2, ch, m3, stride_lo, stride_hi, stride_codes,
            REC, K, NW, R, NWC, BCS, CCS, RI)
        # page terms q . mean + q[R] . (lo + step / 2 - mean[R]), as sparq_tiles' step 1
        base = tl.dot(mean.to(DT), qt, input_precision=DOT_PREC) * ks[:, None]   # [SUB, GP]
        lo = tl.reshape(lo3.to(tl.float32), (SUB, R))
        hi = tl.reshape(hi3.to(tl.float32), (SUB, R))
        off = lo + 0.125 * (hi - lo) - mc.to(tl.float32) * ks[:, None]
        base = tl.dot(off.to(DT), qc, acc=base, input_precision=DOT_PREC)
        x3 = subtile_x(lo3.to(DT), hi3.to(DT), w0, w1, wp, m3, tl.reshape(base, (K, NW, GP)),
                       qbd, magic, DT, K, NW, R, NWC, GP, SUB, ASM, FAST, DOT_PREC)
        tl.store(s_row + offs_g[None, :] * stride_sg + offs_s[:, None],
                 tl.reshape(x3, (SUB, GP)), mask=ok[:, None] & g_ok[None, :])
        xm = tl.where(m3, x3, float("-inf"))
        m_new = tl.maximum(m_acc, xm)
        l_acc = l_acc * tl.exp2(m_acc - m_new) + tl.exp2(xm - m_new)
        m_acc = m_new
    m_run = tl.max(tl.max(m_acc, axis=1), axis=0)
    l_run = tl.sum(tl.sum(l_acc * tl.exp2(m_acc - m_run[None, None, :]), axis=1), axis=0)
    return m_run, l_run
