"""SparQ-style key-code select (``sparse/keycode_sparq.py``) in Triton: the row's channel choice
(``sparq_channels``) and the page scores over those channels (``sparq_page_x``, the score phase
of ``page_select.select_pages(..., sparq_chan=)``, and ``sparq_page_bounds``, the per-head
scores of the generic path). Specs: ``ref.sparq_channels``, ``ref.sparq_page_bounds``
(``kernels/ref_sparq.py``, which also describes the summaries' layout).

Channel choice, grid (B, Hkv): the R channels with the largest ``sum_g |q_gc| * width_c``,
``width`` = kmax - kmin summed over the row's full pages before its last. That sum is kept in a
per-page summary ``wsum`` [S, D] fp32: page p's row holds the sum over the row's pages 0..p,
written by this kernel for the row's page n - 2 (the row's last full page before its last)
and set to -1 (invalid) by ``index``. A program reads page n - 2's row; if invalid, page n - 3's
plus page n - 2's width (the step after a page filled); if that is invalid too (the first
decode step after a prefill), the sum over every page, in the kernel. So a decode step reads
one [D] row of fp32 per (request, KV head), one more row and one box every ``page_size`` steps.
Rows that share a page (a shared prefix) write the same sum there; a torn read (another
program writing it) sees some channels still -1: invalid, recomputed. Then R rounds of a
block max (ties: the lower channel) over the D weights.

Scores, grid (B, Hkv, cdiv(W, BLOCK_W)) / one tile of the fused select. On a chosen channel
``k^ - mean = (lo + step / 2 - mean) + step * code`` with ``step = (hi - lo) / 4``: the first
term is per page, so a page's part of every token's logit is one ``tl.dot`` of the
[BLOCK_W, D] means against the group's [D, GP] queries plus one of the [BLOCK_W, R] offsets
against the [R, GP] queries at the chosen channels. The R channels' codes of BLOCK_W pages are
loaded as [BLOCK_W, page_size / 16, R] words (each channel's words contiguous), unpacked by
shifts and scaled by their step to [BLOCK_W, PS, R] (two operations per code after the
shifts), and one dense ``tl.dot`` [BLOCK_W * PS, R] x [R, GP] (the same R for every page of
the row: no per-page query gather, unlike ``channel_codes.chan_code_page_x``) gives every
token's part; then a per-page log2-sum-exp2. Needs R >= 16 and a power of two (the dot's K)
and page_size a power of two >= 16; the dispatcher runs the reference otherwise. Fixed grids, no host synchronisation.

Not measured on a GPU yet (written without one): BLOCK_W and warps are first guesses.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import channel_codes_supported as supported
from . import patch_triton_interpreter
from .ref_sparq import channel_major
from .sparq_tiles import rec_elem

patch_triton_interpreter()

__all__ = ["sparq_channels", "sparq_page_bounds", "sparq_page_x", "WIDTH_CACHE"]

LOG2E = 1.4426950408889634
# 0: recompute the width sum over every page at every call (the cache is neither read nor
# written) -- to time what the cache saves
WIDTH_CACHE = os.environ.get("SPARSESERVE_SPARQ_WIDTH_CACHE", "1") not in ("0", "")


@triton.jit
def _width_sum(kmin_ptr, kmax_ptr, stride_min, stride_max, stride_bd, pt_row, last, offs_d,
               d_ok, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, RI: tl.constexpr):
    """[BLOCK_D] fp32: kmax - kmin summed over the row's pages 0..last (none if last < 0);
    ``stride_bd``: the boxes' channel stride (1, or a record's, ``sparq_records``); ``RI``:
    the records' interleave (``sparq_tiles.rec_elem``)."""
    acc = tl.zeros([BLOCK_W, BLOCK_D], tl.float32)
    for w0 in range(0, last + 1, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        w_ok = offs_w <= last
        pg = tl.load(pt_row + offs_w, mask=w_ok, other=0).to(tl.int64)
        m2 = w_ok[:, None] & d_ok[None, :]
        lo = tl.load(kmin_ptr + rec_elem(pg[:, None], offs_d[None, :], stride_min, stride_bd, RI),
                     mask=m2, other=0.0)
        hi = tl.load(kmax_ptr + rec_elem(pg[:, None], offs_d[None, :], stride_max, stride_bd, RI),
                     mask=m2, other=0.0)
        acc += hi.to(tl.float32) - lo.to(tl.float32)
    return tl.sum(acc, axis=0)


# sizes that change from step to step are not specialised on (== 1, % 16): a new size
# class would compile a variant mid-serving, which the start-up warm-up cannot foresee
@triton.jit(do_not_specialize=["stride_ptb", "stride_pth"])
def _sparq_channels_kernel(
    q_ptr, kmin_ptr, kmax_ptr, ws_ptr, pt_ptr, np_ptr, out_ptr,
    stride_qb, stride_qh, stride_min, stride_max, stride_bd, stride_ws, stride_wd, stride_ptb,
    stride_pth, stride_npb, stride_ob, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr,
    BLOCK_W: tl.constexpr, USE_CACHE: tl.constexpr, RI: tl.constexpr = 1,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    n = tl.load(np_ptr + b * stride_npb + h)
    pt_row = pt_ptr + b64 * stride_ptb + h * stride_pth
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    t = n - 2  # the row's last full page before its last
    if USE_CACHE:
        has = t >= 0
        page_t = tl.load(pt_row + tl.maximum(t, 0), mask=has, other=0).to(tl.int64)
        ws_t = ws_ptr + rec_elem(page_t, offs_d, stride_ws, stride_wd, RI)
        cur = tl.load(ws_t, mask=d_ok & has, other=0.0)
        cur_ok = (tl.min(tl.where(d_ok, cur, 0.0), axis=0) >= 0).to(tl.int32)  # t < 0: valid
        p_ok = t >= 1
        page_p = tl.load(pt_row + tl.maximum(t - 1, 0), mask=p_ok, other=0).to(tl.int64)
        prev = tl.load(ws_ptr + rec_elem(page_p, offs_d, stride_ws, stride_wd, RI),
                       mask=d_ok & p_ok, other=-1.0)
        prev_ok = (tl.min(tl.where(d_ok, prev, 0.0), axis=0) >= 0).to(tl.int32)
        lo = tl.load(kmin_ptr + rec_elem(page_t, offs_d, stride_min, stride_bd, RI),
                     mask=d_ok & has, other=0.0)
        hi = tl.load(kmax_ptr + rec_elem(page_t, offs_d, stride_max, stride_bd, RI),
                     mask=d_ok & has, other=0.0)
        width = tl.where(cur_ok != 0, cur, prev + (hi.to(tl.float32) - lo.to(tl.float32)))
        if cur_ok + prev_ok == 0:
            width = _width_sum(kmin_ptr, kmax_ptr, stride_min, stride_max, stride_bd, pt_row, t,
                               offs_d, d_ok, BLOCK_D, BLOCK_W, RI)
        if cur_ok == 0:
            tl.store(ws_t, width, mask=d_ok)
    else:
        width = _width_sum(kmin_ptr, kmax_ptr, stride_min, stride_max, stride_bd, pt_row, t,
                           offs_d, d_ok, BLOCK_D, BLOCK_W, RI)
    offs_g = tl.arange(0, GP)
    qa = tl.load(q_ptr + b64 * stride_qb + (h * G + offs_g[:, None]) * stride_qh
                 + offs_d[None, :], mask=(offs_g < G)[:, None] & d_ok[None, :], other=0.0)
    weight = tl.where(d_ok, tl.sum(tl.abs(qa.to(tl.float32)), axis=0) * width, float("-inf"))
    out_row = out_ptr + b64 * stride_ob + h * stride_oh
    for i in tl.static_range(R):
        top = tl.max(weight, axis=0)
        c = tl.min(tl.where(weight == top, offs_d, BLOCK_D), axis=0)  # ties: the lower channel
        tl.store(out_row + i, c)
        weight = tl.where(offs_d == c, float("-inf"), weight)


def sparq_channels(q, kmin, kmax, wsum, page_table, num_pages, channels, out=None,
                   use_cache=None, rec_interleave=1):
    """Triton version of ``ref.sparq_channels`` (same result: [B, Hkv, R] int32, by decreasing
    weight), reading and updating the width sums ``wsum`` [S, D] fp32 (module docstring;
    ``use_cache`` False: recomputed, ``wsum`` untouched; default ``WIDTH_CACHE``). kmin, kmax
    and wsum may be strided views of records (``sparq_records.record_views``), interleaved in
    chunks of ``rec_interleave`` pages (``sparq_records.interleave``; the views then address
    the records as if un-interleaved, ``sparq_tiles.rec_elem``)."""
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    assert channels <= D and kmin.stride(1) == kmax.stride(1) and q.stride(2) == 1
    assert wsum.dtype == torch.float32 and wsum.shape[1] == D
    page_table = page_table.to(torch.int32)
    num_pages = num_pages.to(torch.int32)
    if out is None:
        out = torch.empty(B, Hkv, channels, dtype=torch.int32, device=q.device)
    if B == 0:
        return out
    _sparq_channels_kernel[(B, Hkv)](
        q, kmin, kmax, wsum, page_table, num_pages, out, q.stride(0), q.stride(1),
        kmin.stride(0), kmax.stride(0), kmin.stride(1), wsum.stride(0), wsum.stride(1),
        page_table.stride(0), page_table.stride(1), num_pages.stride(0), out.stride(0),
        out.stride(1),
        G=Hq // Hkv, GP=max(2, triton.next_power_of_2(Hq // Hkv)), D=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)), R=channels, BLOCK_W=16,
        USE_CACHE=WIDTH_CACHE if use_cache is None else use_cache, RI=rec_interleave,
        num_warps=4)
    return out


@triton.jit
def sparq_page_x(mean_ptr, lo_ptr, hi_ptr, codes_ptr, kscale_ptr, ch_row, stride_mean,
                 stride_lo, stride_hi, stride_codes, q_row, stride_qh, qt, page, ok, qk_scale,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
                 PS: tl.constexpr, R: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                 INT8_MEAN: tl.constexpr, DOT_PREC: tl.constexpr, BCS: tl.constexpr,
                 CCS: tl.constexpr):
    """[BLOCK_W, GP] fp32: per head g, log2-sum-exp2 over each page's tokens of
    ``qk_scale * x_gt`` (``ref.sparq_page_bounds``' logit, ``qk_scale`` = scale * log2 e) for
    the pages ``page`` [BLOCK_W] (int64; rows where ``ok`` is False read nothing). ``ch_row``:
    the row's R channels (int32); ``qt`` [BLOCK_D, GP]: the group's queries in the summary
    dtype, zero columns past G; ``q_row``: the pointer to query head h * G. ``BCS`` / ``CCS``:
    the channel strides of the boxes and of the code words (1 and PS / 16 in the first layout,
    a record's in the record layout, ``sparq_records``)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, GP)
    ch = tl.load(ch_row + tl.arange(0, R)).to(tl.int64)                      # [R]
    m2 = ok[:, None] & (offs_d < D)[None, :]
    mean = tl.load(mean_ptr + page[:, None] * stride_mean + offs_d[None, :], mask=m2, other=0)
    mean = mean.to(tl.float32)
    r_ok = ok[:, None]
    mc = tl.load(mean_ptr + page[:, None] * stride_mean + ch[None, :], mask=r_ok, other=0)
    mc = mc.to(tl.float32)                                                   # [BLOCK_W, R]
    if INT8_MEAN:
        ks = tl.load(kscale_ptr + page, mask=ok, other=0.0)
        mean = mean * ks[:, None]
        mc = mc * ks[:, None]
    lo = tl.load(lo_ptr + page[:, None] * stride_lo + ch[None, :] * BCS, mask=r_ok, other=0.0)
    hi = tl.load(hi_ptr + page[:, None] * stride_hi + ch[None, :] * BCS, mask=r_ok, other=0.0)
    lo = lo.to(tl.float32)
    step = (hi.to(tl.float32) - lo) * 0.25                                   # [BLOCK_W, R]
    # k^ - mean = (lo + step / 2 - mean) + step * code on a chosen channel: the first term is
    # per page, so it joins q . mean; per token only the code times its step is left
    off = lo + 0.5 * step - mc
    # the group's queries at the row's channels [R, GP] (zero past G)
    qc = tl.load(q_row + offs_g[None, :] * stride_qh + ch[:, None],
                 mask=(offs_g < G)[None, :], other=0.0).to(qt.dtype)
    base = tl.dot(mean.to(qt.dtype), qt, input_precision=DOT_PREC)         # [BLOCK_W, GP]
    base = tl.dot(off.to(qt.dtype), qc, acc=base, input_precision=DOT_PREC)
    # the chosen channels' codes, channel-major: NWC words per (page, channel), 16 codes each
    NWC: tl.constexpr = PS // 16
    cptr = codes_ptr + page[:, None] * stride_codes + ch[None, :] * CCS      # [BLOCK_W, R]
    if NWC == 1:
        words = tl.expand_dims(tl.load(cptr, mask=r_ok, other=0), 1)       # [BLOCK_W, 1, R]
    else:
        words = tl.load(cptr[:, None, :] + tl.arange(0, NWC)[None, :, None],
                        mask=r_ok[:, :, None], other=0)                      # [BLOCK_W, NWC, R]
    code = (words[:, :, None, :] >> (tl.arange(0, 16) * 2)[None, None, :, None]) & 3
    code = tl.reshape(code, (BLOCK_W, PS, R)).to(qt.dtype)                  # token t = 16 j + i
    dev = code * step.to(qt.dtype)[:, None, :]                               # [BLOCK_W, PS, R]
    # one dense dot for every token of the tile: the same R channels on every page
    xt = tl.dot(tl.reshape(dev, (BLOCK_W * PS, R)), qc, input_precision=DOT_PREC)
    x3 = (tl.reshape(xt, (BLOCK_W, PS, GP)) + base[:, None, :]) * qk_scale
    mx = tl.max(x3, axis=1)
    return mx + tl.log2(tl.sum(tl.exp2(x3 - mx[:, None, :]), axis=1))


@triton.jit(do_not_specialize=["stride_ptb", "stride_pth", "W"])
def _sparq_scores_kernel(
    q_ptr, mean_ptr, lo_ptr, hi_ptr, codes_ptr, kscale_ptr, ch_ptr, pt_ptr, np_ptr, out_ptr,
    stride_qb, stride_qh, stride_mean, stride_lo, stride_hi, stride_codes, stride_chb,
    stride_chh, stride_ptb, stride_pth, stride_npb, stride_ob, stride_oh, stride_og,
    W, qk_scale, inv_qk_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PS: tl.constexpr, R: tl.constexpr, BLOCK_W: tl.constexpr, INT8_MEAN: tl.constexpr,
    DOT_PREC: tl.constexpr, BCS: tl.constexpr, CCS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    n = tl.load(np_ptr + b * stride_npb + h)
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, GP)
    offs_w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = offs_w < n
    page = tl.load(pt_ptr + b64 * stride_ptb + h * stride_pth + offs_w, mask=w_ok, other=0)
    q_row = q_ptr + b64 * stride_qb + h * G * stride_qh
    qt = tl.load(q_row + offs_g[None, :] * stride_qh + offs_d[:, None],
                 mask=(offs_d < D)[:, None] & (offs_g < G)[None, :], other=0.0)
    qt = qt.to(lo_ptr.dtype.element_ty)  # the dots in the summary dtype
    x = sparq_page_x(mean_ptr, lo_ptr, hi_ptr, codes_ptr, kscale_ptr,
                     ch_ptr + b64 * stride_chb + h * stride_chh, stride_mean, stride_lo,
                     stride_hi, stride_codes, q_row, stride_qh, qt, page.to(tl.int64), w_ok,
                     qk_scale, D, BLOCK_D, BLOCK_W, PS, R, G, GP, INT8_MEAN, DOT_PREC, BCS, CCS)
    bound = tl.where(w_ok[:, None], x * inv_qk_scale, float("-inf"))     # bound units
    o = out_ptr + b64 * stride_ob + h * stride_oh + offs_g[None, :] * stride_og + offs_w[:, None]
    tl.store(o, bound, mask=(offs_w < W)[:, None] & (offs_g[None, :] < G))


def sparq_page_bounds(q, kmean, kscale, kmin, kmax, codes, chosen, page_table, num_pages,
                      out=None, block_w=16, num_warps=4):
    """Triton version of ``ref.sparq_page_bounds`` (same arguments and result:
    [B, Hkv, G, W] float32; kmin / kmax / codes may be record views, ``sparq_records``).
    R = chosen.shape[-1] must pass ``kernels.channel_codes_supported``."""
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    G, R = Hq // Hkv, chosen.shape[-1]
    assert supported(R, D), f"{R} decoded channels: use the reference"
    codes = channel_major(codes, D)                                   # [S, D, PS / 16]
    ps = codes.shape[2] * 16
    assert ps & (ps - 1) == 0 and ps >= 16
    if not q.is_cuda and kmin.dtype == torch.bfloat16:  # the interpreter's bf16 dot (triton#11584)
        q, kmin, kmax = q.float(), kmin.float(), kmax.float()
        kmean = kmean if kscale is not None else kmean.float()
    for t in (q, kmean, codes):
        assert t.stride(-1) == 1
    assert kmin.stride(1) == kmax.stride(1)
    assert codes.dtype == torch.int32
    chosen = chosen.to(torch.int32)
    assert chosen.stride(2) == 1
    int8 = kscale is not None
    ks = kscale.reshape(-1) if int8 else kmin  # any tensor when unused
    page_table = page_table.to(torch.int32)
    num_pages = num_pages.to(torch.int32)
    if out is None:
        out = torch.empty(B, Hkv, G, W, dtype=torch.float32, device=q.device)
    if B == 0 or W == 0:
        return out
    scale = D ** -0.5
    _sparq_scores_kernel[(B, Hkv, triton.cdiv(W, block_w))](
        q, kmean, kmin, kmax, codes, ks, chosen, page_table, num_pages, out,
        q.stride(0), q.stride(1), kmean.stride(0), kmin.stride(0), kmax.stride(0),
        codes.stride(0), chosen.stride(0), chosen.stride(1), page_table.stride(0),
        page_table.stride(1), num_pages.stride(0), out.stride(0), out.stride(1), out.stride(2),
        W, scale * LOG2E, 1.0 / (scale * LOG2E),
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)), PS=ps, R=R, BLOCK_W=block_w,
        INT8_MEAN=int8, DOT_PREC="ieee" if kmin.dtype == torch.float32 else "tf32",
        BCS=kmin.stride(1), CCS=codes.stride(1), num_warps=num_warps)
    return out
