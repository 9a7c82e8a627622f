"""keycode2-sparq's score phase written per lane (``select_pages(..., sparq_kernel=5)``,
``keycode2-sparq@score_kernel=5``): every warp scores its own 16-page chunks with
``mma.sync`` on operands it builds in registers, no shared memory, no barrier. Spec:
``ref.sparq_page_bounds`` (log2 units), as ``sparq_stream``.

Why. ``sparq_stream`` (kernel 3) issues ~186 warp-instructions per page at 128k x 16 and is
bound on-chip (L1/shared pipe 64 %, 7 barriers per iteration: Nsight Compute and offline SASS,
docs/results/sparse.md): Triton's ``tl.dot`` wants its operands in the mma layouts, so the
records, means and decoded codes go through shared memory and every warp recomputes the
16-row page-term tile. Here the kernel holds one element per thread (tensors of ``NW * 32``:
element ``e`` is lane ``e % 32`` of warp ``e // 32``) and each lane loads exactly the words
its mma fragments need, so the only data movement between lanes is ``shfl``.

Per warp and chunk of 16 pages (``m16n8k16`` fp16 mmas, fp32 accumulation; lane
``(gr, t) = (lane // 4, lane % 4)``, the fragments' groupID / thread-in-group):

1. Page terms, pages ``gr`` and ``gr + 8`` of the chunk as the mma rows: the int8 means on
   ``D / 16`` k-steps, the lane's K slots being its own ``D / 4`` contiguous channels (one or
   two 16-byte loads per page), read as fp16 subnormals ``(mean + 128) * 2^-24`` (a byte
   into a half is a ``prmt`` and a ``lop3``), minus the same mma of a constant 128 (computed
   once per row), times ``2^24`` and the page's scale; and the centring term
   ``q[R] . (lo + step / 2 - mean[R] * scale)`` on one k-step of the 16 chosen channels (slot
   ``t + 4 m``: the lane's records). The B columns are ``n = 2 h + s'``, head ``h``
   duplicated, so lane ``(gr, t)`` receives both terms of head ``t``.
2. Tokens, page by page: rows = the page's tokens ``gr`` / ``gr + 8`` of its two code words,
   K = (chosen channel, code word), N = (head, code word) block-diagonal, as ``sparq_tiles``
   lays them out; the A operand is the codes' bits themselves as fp16 subnormals
   ``code * 4^j * 2^-24`` (``j = gr % 4``, a token's bit position in its byte: one ``lop3``
   a register, and a shift for row ``gr + 8``, no conversion, no per-element multiply); the
   code words are loaded once a warp at the chunk's start, each by one lane, and reach the
   lanes that need them by shuffles (``_chunk_codes``: no load on a page's chain, an eighth of
   the L1 requests of a load per lane), the B operand is ``q[h, c] * step_c * 2^-4`` for the
   page (the step folded into B instead of into every decoded code; the widths ``hi - lo``
   shuffled as packed fp16 from the lanes that loaded the page's boxes in step 1, one
   ``HMUL2`` a register), and the mma's output, scaled by ``4^(-j) * 2^28`` per
   lane, plus the page's centring term (one fma) is each token's approximate logit minus the
   mean key's, ``d``. Those deviations are centred (the mean of a page's keys is their
   centre), so ``x = base + log2 sum_t exp2(d_t)`` needs no running max (the log is clamped
   at 126 against an absurd overflow, NaN kept); the sum over a page's 32 tokens is the lane's
   4, then the 8 lanes of a ``t``
   are summed for 8 pages at once (``_sum8``: 7 ``shfl.bfly`` for 8 pages, lane ``gr``
   receiving page ``gr``'s sum).
3. The chunk's 16 x values end on lanes ``(p % 8, t)``; they are stored and folded into the
   lane's running (max, sum of exp2) once per chunk, reduced over the program at the end.

fp16 operands: ``q * scale``, ``q * step / 64`` (a box's width rounded to fp16, then the
product rounded again: two roundings), the widths themselves (clamped at 65504) and the
centring terms must stay below 65504 (a key of magnitude ~10^4 would overflow them: bf16 keys
that large do not occur in the models served; the ``sparq_stream`` path has no such limit).
Same numbers as the reference to fp16 rounding of those operands (``sparq_stream`` rounds the
decoded codes times step to bf16).

Supported: 4-word records with a 16-bit box (``REC`` 1 bf16, 2 fp16), page 32, R = 16, GQA
groups up to 4, head_dim 64 or 128, 16-byte aligned means; ``select_pages`` falls back to
``sparq_stream`` otherwise. On CPU (Triton's interpreter) the ``mma``, ``shfl``, ``prmt`` and
vector loads are emulated by gathers over the lane axis (``FAST`` False), so CI runs this
module's fragment and bit arithmetic; on the GPU they are inline PTX.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import patch_triton_interpreter
from .lane_ops import (byte_pair, f16x2, hmul2_half, ldg1_at, ldg4, mma_m16n8k16, prmt, shfl_f32,
                       shfl_idx, shfl_xor)
from .sparq_tiles import _rec_box, log2_fast, rec_word

patch_triton_interpreter()

__all__ = ["sparq_score_lanes", "LANE_PAGES", "lanes_supported"]

LANE_PAGES = 16  # pages of a warp's chunk (the mma's 16 rows in the page-term step)


def lanes_supported(rec_kind: int, page_size: int, channels: int, group: int,
                    head_dim: int) -> bool:
    """Whether ``sparq_score_lanes`` covers a configuration (else ``sparq_stream`` runs)."""
    return rec_kind in (1, 2) and page_size == 32 and channels == 16 and group <= 4 \
        and head_dim in (64, 128)


# --- the score phase ---

@triton.jit
def _sum8(v, gr, N: tl.constexpr, FAST: tl.constexpr):
    """Sums over the 8 lanes of each thread-in-group ``t`` of 8 values at once (``v``: the
    lane's 8-tuple, one per page), lane ``gr`` receiving page ``gr``'s: at each level a lane
    keeps the half of the pages whose page bit matches its own lane bit and adds its
    partner's other half (7 shuffles for 8 pages instead of 3 each)."""
    b2 = (gr // 4) % 2 == 1
    b1 = (gr // 2) % 2 == 1
    b0 = gr % 2 == 1
    w = ()
    for i in tl.static_range(4):  # lane bit 2 (lane ^ 16): pages b2 * 4 + i
        w = w + (tl.where(b2, v[4 + i], v[i]) + shfl_xor(tl.where(b2, v[i], v[4 + i]), 16,
                                                           N, FAST),)
    u = ()
    for i in tl.static_range(2):  # lane bit 1 (lane ^ 8): pages b2 * 4 + b1 * 2 + i
        u = u + (tl.where(b1, w[2 + i], w[i]) + shfl_xor(tl.where(b1, w[i], w[2 + i]), 8,
                                                           N, FAST),)
    return tl.where(b0, u[1], u[0]) + shfl_xor(tl.where(b0, u[0], u[1]), 4, N, FAST)


@triton.jit
def _f16_q(qh_row, c, ok, qk_scale):
    """fp32 ``q[c] * qk_scale`` of the lane's head (0 where not ``ok``: padding heads)."""
    return tl.load(qh_row + c, mask=ok, other=0.0).to(tl.float32) * qk_scale


@triton.jit
def _mean_a(w, FAST: tl.constexpr):
    """A registers of one mean k-step from a word of 4 int8 means: bytes (0, 1) and (2, 3) as
    fp16 subnormals ``(mean + 128) * 2^-24`` (the byte with its sign bit flipped)."""
    lo = byte_pair(w, w, 0, 1, FAST)
    hi = byte_pair(w, w, 2, 3, FAST)
    return (lo & 0x00FF00FF) ^ 0x00800080, (hi & 0x00FF00FF) ^ 0x00800080


@triton.jit
def _mean_mma(wa, wb, bm, c, N: tl.constexpr, D: tl.constexpr, FAST: tl.constexpr):
    """The page-term mma over the means: rows pages a / b (the lane's D / 16 words ``wa`` /
    ``wb``, tuples), B ``bm`` (tuple of D / 8 registers), C ``c`` (4-tuple)."""
    for ks in tl.static_range(D // 16):
        a0, a2 = _mean_a(wa[ks], FAST)
        a1, a3 = _mean_a(wb[ks], FAST)
        c = mma_m16n8k16(a0, a1, a2, a3, bm[2 * ks], bm[2 * ks + 1], c[0], c[1], c[2], c[3], N,
                         FAST)
    return c


@triton.jit
def _mean_words(mean_ptr, pid, stride_mean, t, D: tl.constexpr, FAST: tl.constexpr):
    """The lane's D / 4 int8 means (channels D / 4 * t ..) of page ``pid`` as D / 16 words."""
    p = (mean_ptr + pid * stride_mean + (D // 4) * t).to(tl.pointer_type(tl.int32),
                                                        bitcast=True)
    w = ldg4(p, FAST)
    if D == 128:
        w = w + ldg4(p + 4, FAST)
    return w


@triton.jit
def _rec_ptrs(page_rec, chw):
    """The lane's 4 records of a page: ``page_rec`` the page's record pointer (channel 0,
    ``rec_word(page, 0, ...)``), ``chw`` the channels' word offsets (int32)."""
    return page_rec + chw[0], page_rec + chw[1], page_rec + chw[2], page_rec + chw[3]


@triton.jit
def _centring(codes_ptr, mean_ptr, pid, roff, ks, chs, chw, stride_mean, REC: tl.constexpr):
    """Of page ``pid`` (its records at word ``roff``) at the lane's 4 channels: ``lo + step /
    2 - mean * scale`` and ``hi - lo`` (4-tuples of [N] fp32)."""
    rp = _rec_ptrs(codes_ptr + roff, chw)
    off = ()
    width = ()
    for m in tl.static_range(4):
        w = tl.load(rp[m])
        lo, hi = _rec_box(w, w, REC)
        mc = tl.load(mean_ptr + pid * stride_mean + chs[m]).to(tl.float32)
        off = off + (lo + 0.125 * (hi - lo) - mc * ks,)
        width = width + (hi - lo,)
    return off, width


@triton.jit
def _widths_f16(w, FAST: tl.constexpr):
    """A page's 4 slot widths (fp32) as two packed fp16 words (slots 0, 1 and 2, 3), held at
    fp16's largest finite value (an inf width times the zero half of a B column is NaN)."""
    return (f16x2(tl.minimum(w[0], 65504.0), tl.minimum(w[1], 65504.0), FAST),
            f16x2(tl.minimum(w[2], 65504.0), tl.minimum(w[3], 65504.0), FAST))


@triton.jit
def _chunk_codes(codes_ptr, pt_row, cc, c1, n, gr, chw, stride_codes, RI: tl.constexpr,
                 N: tl.constexpr, FAST: tl.constexpr):
    """The chunk's code words, each loaded by one lane, no copies: lane ``(gr, t)`` loads word
    ``1 + gr % 2`` of the records of pages ``4 i + gr // 2`` (i 0..3) at its channel slots
    ``t + 4 m``, trades it with its partner (``lane ^ 4``, which holds the record's other
    word) and keeps the bytes of row half ``s = gr % 2``: ``[w0.b_s, w0.b_(s+2), w1.b_s,
    w1.b_(s+2)]``, rows ``4 s .. 4 s + 3`` and ``8 + 4 s ..`` of both words (``_page_partial``
    reads its A operands out of that). 16 registers, index ``4 m + i``, all issued at the
    chunk's start: a page's token step then waits on shuffles, never on a load (before, the 8
    lanes of a channel slot each loaded the page's two words: 8 times the L1 requests)."""
    e = tl.arange(0, N)
    partner = (e % 32) ^ 4
    w = gr % 2
    # prmt(v, partner's v): on w = 0 lanes a = word 0, on w = 1 lanes a = word 1, b = word 0
    sel = tl.where(w == 0, 0x6420, 0x3175)
    rec = ()
    for i in tl.static_range(4):
        page = cc * 16 + 4 * i + gr // 2
        # pages not scored read page 0 (a valid row) unpredicated; masked downstream
        pid = tl.load(pt_row + page, mask=(page < n - 1) & (cc < c1), other=0)
        rec = rec + (codes_ptr + rec_word(pid.to(tl.int64), 0, stride_codes, RI),)
    x = ()
    for m in tl.static_range(4):
        word = chw[m] + 1 + w
        for i in tl.static_range(4):
            v = ldg1_at(rec[i], word, FAST)
            x = x + (prmt(v, shfl_idx(v, partner, N, FAST), sel, FAST),)
    return x


@triton.jit
def _page_partial(y, o, width, qeo, cmask, isig, N: tl.constexpr, FAST: tl.constexpr):
    """The lane's part of sum_t exp2(d_t) over one page's tokens for head t (its 4 tokens:
    ``_sum8`` adds the 8 lanes of a t): ``d_t`` = the token's approximate logit minus the mean
    key's; ``y`` the page's code bytes at the lane's 4 channel slots (``_chunk_codes``,
    shuffled from their loaders), ``o`` [N] its centring term, ``width`` its 4 slots' box
    widths as 2 packed fp16 words, ``qeo`` the B columns' query per slot (packed fp16)."""
    a = ()
    b = ()
    for m in tl.static_range(4):
        # B: the width of slot t + 4 m (fp16, packed two slots a word) times the lane's
        # (q even, q odd) column; A: bytes 0 / 2 of y are row gr's (words 0 / 1), bytes 1 / 3
        # row gr + 8's, fp16 subnormals once masked to the token's 2 bits
        b = b + (hmul2_half(width[m // 2], m % 2, qeo[m], FAST),)
        a = a + (y[m] & cmask, (y[m] >> 8) & cmask)
    z = tl.zeros_like(o)
    d0, d1, d2, d3 = mma_m16n8k16(a[0], a[1], a[2], a[3], b[0], b[1], z, z, z, z, N, FAST)
    d0, d1, d2, d3 = mma_m16n8k16(a[4], a[5], a[6], a[7], b[2], b[3], d0, d1, d2, d3, N, FAST)
    # d = o + D / (4^j 2^-28), one fma each; an exp2 past fp32's range (a deviation > 127:
    # no real key) is inf, clamped after the log
    return tl.exp2(d0 * isig + o) + tl.exp2(d1 * isig + o) + tl.exp2(d2 * isig + o) \
        + tl.exp2(d3 * isig + o)


@triton.jit
def sparq_score_lanes(q_row, stride_qh, mean_ptr, codes_ptr, kscale_ptr, ch_row, stride_mean,
                      stride_codes, pt_row, s_row, stride_sg, n, c0, c1, qk_scale,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, NW: tl.constexpr,
                      REC: tl.constexpr, RI: tl.constexpr, FAST: tl.constexpr):
    """``sparq_stream``'s contract with chunks of ``LANE_PAGES`` pages, chunk ``c0 + k * NW +
    w`` on warp ``w``: writes ``s_row[g, page]`` for the full pages of chunks ``c0 .. c1`` and
    returns the row's (max, sum of exp2(x - max)) per head [GP] (GP = 4). ``codes_ptr``: the
    4-word records (int32), ``ch_row``: the row's 16 channels (module docstring)."""
    N: tl.constexpr = NW * 32
    e = tl.arange(0, N)
    lane = e % 32
    warp = e // 32
    gr = lane // 4  # the mma fragments' groupID
    t = lane % 4    # ... and thread-in-group: the head of the lane's D columns
    hb = gr // 2    # the head of the lane's B column (n = gr = 2 h + word)
    h_ok = hb < G
    qh_row = q_row + tl.minimum(hb, G - 1) * stride_qh
    j = (gr % 4).to(tl.float32)  # a row's token code sits at bits 2 j of its byte
    isig = tl.exp2(28.0 - 2.0 * j)  # logit units per unit of the token mma's D: 4^j 2^-24 2^-4
    cmask = (3 << (2 * (gr % 4))) * 0x10001
    row_half = gr // 4   # token gr's byte in its code word (gr + 8's: row_half + 2)
    even = (gr % 2) == 0
    # the lane's 4 channels (K slots t + 4 m) and its head's query there
    chs = ()
    chw = ()
    qeo = ()  # the token mma's B column of the lane's head and word, per slot (packed fp16)
    qc = ()
    for m in tl.static_range(4):
        c = tl.load(ch_row + t + 4 * m).to(tl.int64)
        qv = _f16_q(qh_row, c, h_ok, qk_scale)
        chs = chs + (c,)
        chw = chw + (rec_word(0, c, stride_codes, RI).to(tl.int32),)
        qc = qc + (qv,)
        qs = qv * 0.015625  # B = q * step * 2^-4, step = (hi - lo) / 4
        qeo = qeo + (f16x2(tl.where(even, qs, 0.0), tl.where(even, 0.0, qs), FAST),)
    b_off0 = f16x2(qc[0], qc[1], FAST)  # the centring mma's B: K (2t, 2t + 1) = slots t, t + 4
    b_off1 = f16x2(qc[2], qc[3], FAST)
    bm = ()  # the mean mma's B: K (2t, 2t + 1), (2t + 8, 2t + 9) = channels D / 4 t + 4 ks + 0..3
    for ks in tl.static_range(D // 16):
        cb = (D // 4) * t + 4 * ks
        bm = bm + (f16x2(_f16_q(qh_row, cb, h_ok, qk_scale),
                          _f16_q(qh_row, cb + 1, h_ok, qk_scale), FAST),
                   f16x2(_f16_q(qh_row, cb + 2, h_ok, qk_scale),
                          _f16_q(qh_row, cb + 3, h_ok, qk_scale), FAST))
    zf = tl.zeros([N], tl.float32)
    zw = ()
    for ks in tl.static_range(D // 16):
        zw = zw + (tl.zeros([N], tl.int32),)
    bias = _mean_mma(zw, zw, bm, (zf, zf, zf, zf), N, D, FAST)[0]  # means of 0: 128 * sum q
    m_acc = tl.full([N], -1e30, tl.float32)  # per lane (head t): running max of its pages
    l_acc = tl.zeros([N], tl.float32)        # and sum of exp2(x - max)
    t_ok = t < G
    for c in range(c0, c1, NW):
        cc = c + warp
        page_a = cc * 16 + gr
        ok_a = (page_a < n - 1) & (cc < c1)  # full pages of the warp's chunk
        ok_b = (page_a + 8 < n - 1) & (cc < c1)
        # pages not scored read page 0 (a valid row) unpredicated; their x is masked below
        pt_a = tl.load(pt_row + page_a, mask=ok_a, other=0)
        pt_b = tl.load(pt_row + page_a + 8, mask=ok_b, other=0)
        pid_a = pt_a.to(tl.int64)
        pid_b = pt_b.to(tl.int64)
        ks_a = tl.load(kscale_ptr + pid_a)
        ks_b = tl.load(kscale_ptr + pid_b)
        # 1. page terms of pages gr, gr + 8 for head t
        dm = _mean_mma(_mean_words(mean_ptr, pid_a, stride_mean, t, D, FAST),
                       _mean_words(mean_ptr, pid_b, stride_mean, t, D, FAST),
                       bm, (zf, zf, zf, zf), N, D, FAST)
        base_a = (dm[0] - bias) * 16777216.0 * ks_a
        base_b = (dm[2] - bias) * 16777216.0 * ks_b
        roff_a = rec_word(pid_a, 0, stride_codes, RI)  # the pages' records (channel 0)
        roff_b = rec_word(pid_b, 0, stride_codes, RI)
        xc = _chunk_codes(codes_ptr, pt_row, cc, c1, n, gr, chw, stride_codes, RI, N, FAST)
        oa, wa = _centring(codes_ptr, mean_ptr, pid_a, roff_a, ks_a, chs, chw, stride_mean, REC)
        ob, wb = _centring(codes_ptr, mean_ptr, pid_b, roff_b, ks_b, chs, chw, stride_mean, REC)
        o_a, _, o_b, _ = mma_m16n8k16(f16x2(oa[0], oa[1], FAST), f16x2(ob[0], ob[1], FAST),
                              f16x2(oa[2], oa[3], FAST), f16x2(ob[2], ob[3], FAST),
                              b_off0, b_off1, zf, zf, zf, zf, N, FAST)
        wa01, wa23 = _widths_f16(wa, FAST)  # shuffled as packed fp16 pairs
        wb01, wb23 = _widths_f16(wb, FAST)
        # 2. tokens, page by page: the centring term and widths from lane (p % 8, t), the
        # code bytes from their loader (_chunk_codes: page p on lanes (2 (p % 4) + s, t),
        # s = the row half); x of page p ends on lanes (p % 8, t)
        sa = ()
        sb = ()
        for p in tl.static_range(16):
            src = 4 * (p % 8) + t
            if p < 8:
                o = shfl_f32(o_a, src, N, FAST)
                wd = (shfl_idx(wa01, src, N, FAST), shfl_idx(wa23, src, N, FAST))
            else:
                o = shfl_f32(o_b, src, N, FAST)
                wd = (shfl_idx(wb01, src, N, FAST), shfl_idx(wb23, src, N, FAST))
            csrc = 4 * (2 * (p % 4) + row_half) + t
            y = ()
            for m in tl.static_range(4):
                y = y + (shfl_idx(xc[4 * m + p // 4], csrc, N, FAST),)
            part = _page_partial(y, o, wd, qeo, cmask, isig, N, FAST)
            if p < 8:
                sa = sa + (part,)
            else:
                sb = sb + (part,)
        # min.f32 returns the number for a NaN operand: propagate it, as the reference does
        xa = base_a + tl.minimum(log2_fast(_sum8(sa, gr, N, FAST), FAST), 126.0,
                                 propagate_nan=tl.PropagateNan.ALL)
        xb = base_b + tl.minimum(log2_fast(_sum8(sb, gr, N, FAST), FAST), 126.0,
                                 propagate_nan=tl.PropagateNan.ALL)
        # 3. store and fold into the running (max, sum)
        tl.store(s_row + t * stride_sg + page_a, xa, mask=ok_a & t_ok)
        tl.store(s_row + t * stride_sg + page_a + 8, xb, mask=ok_b & t_ok)
        xa = tl.where(ok_a & t_ok, xa, float("-inf"))
        xb = tl.where(ok_b & t_ok, xb, float("-inf"))
        m_new = tl.maximum(m_acc, tl.maximum(xa, xb))
        l_acc = l_acc * tl.exp2(m_acc - m_new) + tl.exp2(xa - m_new) + tl.exp2(xb - m_new)
        m_acc = m_new
    m2 = tl.reshape(m_acc, (N // 4, 4))  # [lane groups, head t]
    l2 = tl.reshape(l_acc, (N // 4, 4))
    m_run = tl.max(m2, axis=0)
    l_run = tl.sum(l2 * tl.exp2(m2 - m_run[None, :]), axis=0)
    return m_run, l_run
