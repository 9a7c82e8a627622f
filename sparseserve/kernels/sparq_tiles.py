"""The score phase of ``keycode2-sparq``'s fused select, laid out for the tensor cores
(``page_select.select_pages(..., sparq_chan=, sparq_kernel=2)``; ``sparq_stream`` runs the same
arithmetic in 16-page steps and is the default since it measured 1.37x faster (sparse.md,
twenty-first session); ``sparq_codes.sparq_page_x`` is the first version, kept for comparison:
``SPARSESERVE_SPARQ_KERNEL=1``). The sub-tile helpers here serve both tile versions. Spec:
``ref.sparq_page_bounds`` (``kernels/ref_sparq.py``), in log2 units.

Why a second version. The first decodes a tile of 16 pages x 32 tokens x R channels into one
``[512, R] x [R, GP]`` dot and reduces its ``[16, 32, GP]`` logits per page. Compiled for the
H200 (sm_90, Triton 3.6) it measured 1.5 ms per layer at 128k x 16 (0.8x dense paged decode)
while its bytes need ~0.13 ms: the SASS of its loop is ~3,100 instructions per warp per 16
pages, from (1) GP = 16 columns for a GQA group of 4 (the dot's N was padded to 16: 4x the
post-dot work), (2) a page's 32 tokens split over two warps (every per-page reduction a
shared-memory round trip with barriers), (3) a 4x-redundant ``[16, D]`` mean dot (16 rows
for 4 warps), (4) the exact (libdevice) ``log2`` per page and head, and (5) per-element
unpacking. Here, per (request, KV head) row and chunk of ``BW`` (64) pages:

1. Page terms: ``q . mean`` (the int8 mean is exact in the dot dtype; its scale after the dot)
   plus ``q[R] . off``, ``off = lo + step / 2 - mean[R]`` (``step = (hi - lo) / 4``), as two
   ``[BW, *] x [*, GP]`` dots (64 rows: no redundancy), queries pre-scaled by
   ``scale * log2 e``; written to the score row (the scratch ``xs``), re-read per sub-tile.
2. Tokens, per sub-tile of ``SUB`` (16) pages: page ``k * NW + w`` goes to warp ``w`` (the mma
   tiles of a warp are 16 rows: rows ordered (k, w, token-in-word i), one page's 16 tokens per
   tile), and a page's ``PS / 16`` code words of a channel become the K axis next to the
   channel: ``a[(k, w, i), (r, s)] = step_r * code(word s, token i)``, against a
   block-diagonal ``[(r, s), (g, s')]`` query matrix (``qc[r, g]`` where ``s == s'``). So the
   dot's N is ``GP * PS / 16`` (8 for G = 4, page 32: no padding), its K ``R * PS / 16``, and
   every token of a page lies in one warp: the max / sum over a page's tokens are register
   reductions plus 3 shuffle levels.
3. Decode: the 2-bit code becomes a float by its bits, ``1 + code * 2^-23`` (or, with ``ASM``,
   two bf16 at once, ``1 + code * 2^-7``), and ``v * K - K`` (``K = step * 2^23``, resp.
   ``128 step``) is ``code * step`` rounded once: 2 instructions per code (1 + 1/2 with
   ``ASM``: prmt, shift, lop3, ``fma.rn.bf16x2`` per pair of tokens 16 apart), no int-to-float
   conversion. The ``(lo + step / 2)`` offset went into the page term.
4. ``lse = max + log2(sum exp2(x - max))`` per page and head (``lg2.approx`` on the GPU); the
   row's running max / sum-of-exp2 are kept per (page slot, head) in registers and reduced
   across the program once at the end.

Compiled offline for sm_90 (no GPU here; ``triton.compile`` to SASS, Llama-3-8B shapes, bf16):
the score loop is ~2,320 SASS instructions per warp per 64 pages (4 warps; the first version:
~12,400 for 64 pages; without ``ASM`` ~2,930), 158 registers, no spills. Not measured yet.
``ASM`` (bf16 summaries, page 32, on the GPU) relies on ``inline_asm_elementwise(pack=2)``
grouping each thread's innermost register pair, which is the join axis (word 0, word 1):
checked in the compiled TTGIR (the asm's layout has register bit 0 on that axis), and on the
GPU by ``tests/kernels/test_sparq_codes.py::test_fused_select_scores_match_reference``.
``SPARSESERVE_SPARQ_ASM=0`` turns it off; ``SPARSESERVE_SPARQ_KERNEL=1`` runs the first
version (both also per call: ``select_pages(sparq_kernel=, sparq_asm=)``).

Summary layouts (``sparq_records``): with 4-word records (bf16 / fp16 at page 16 or 32, the
default) each (page, chosen channel) is one aligned 16-byte load in step 2 (box and code words
split in registers; the page terms of step 1 load the box word alone, whose sector step 2 then
finds in cache), about 15 sectors a page for R = 16 of D = 128 instead of ~28; otherwise, and
for the first layout, the box and code words are loaded through their channel strides. The
arithmetic is the same in both: the same scores bit for bit.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["sparq_score_tiles", "log2_fast", "SPARQ_KERNEL", "SPARQ_ASM", "TILE_PAGES"]

# 0 (the default): 5, sparq_lanes, on CUDA, 3 (sparq_stream) in the interpreter; 4: the stream
# in 2-warp programs; 2: this module's score phase; 1: sparq_codes.sparq_page_x
SPARQ_KERNEL = int(os.environ.get("SPARSESERVE_SPARQ_KERNEL", 0))
SPARQ_ASM = os.environ.get("SPARSESERVE_SPARQ_ASM", "1") not in ("0", "")
TILE_PAGES = 64  # BW: pages per chunk (page terms), sub-tiles of 16 for the tokens
MAGIC_F32 = 0x3F800000  # the bits of 1.0f (a kernel argument: the compiler keeps it in a
# register, so ``(x & 3) | magic`` is one lop3 instead of two)


@triton.jit
def log2_fast(x, FAST: tl.constexpr):
    """log2 of fp32 ``x``: ``lg2.approx`` on the GPU (``FAST``), ``tl.log2`` otherwise (the
    interpreter; tl.log2 compiles to libdevice's exact log2, ~14 instructions)."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _word_dev(words, kk, magic, DT: tl.constexpr, FAST: tl.constexpr):
    """[K, NW, 16, R] ``code * step`` of each token i of ``words`` [K, NW, R] (codes at bits
    2 i), ``kk`` = step * 2^23 [K, NW, 1, R] fp32: ``v = 1 + code * 2^-23`` by its bits, then
    ``fma(v, kk, -kk)`` (one rounding of code * step; the interpreter's fma rounds twice, so
    there ``(v - 1) * kk``, the same number)."""
    sh = (tl.arange(0, 16) * 2)[None, None, :, None]
    v = (((words[:, :, None, :] >> sh) & 3) | magic).to(tl.float32, bitcast=True)
    if FAST:
        return tl.fma(v, kk, -kk).to(DT)
    else:
        return ((v - 1.0) * kk).to(DT)


@triton.jit
def _word_pair_dev_bf16(w0, w1, lo3, hi3, K: tl.constexpr, NW: tl.constexpr,
                        R: tl.constexpr):
    """[K, NW, 16, R, 2] bf16 ``code * step`` of tokens i (word 0) and 16 + i (word 1), two at
    a time: prmt of byte i // 4 of both words, shift, lop3 into two bf16 ``1 + code * 2^-7``,
    ``fma.rn.bf16x2`` by ``128 step`` minus ``128 step``. Needs the asm's element pairs to be
    the join's (word 0, word 1): the join axis is each thread's innermost register pair."""
    ii = tl.arange(0, 16)[None, None, :, None]
    sel = (ii // 4) | ((ii // 4 + 4) << 8)  # prmt: a.byte[i / 4] -> byte 0, b.byte[i / 4] -> 2
    z = tl.zeros([K, NW, 16, R, 2], tl.int32)
    wj = tl.join(w0, w1)[:, :, None, :, :] + z
    sj = tl.join(sel + tl.zeros_like(ii), ii % 4 * 2)[:, :, :, :, :] + z
    kb = ((hi3 - lo3) * 32.0).to(tl.bfloat16)[:, :, None, :]                 # 128 step
    kz = tl.zeros([K, NW, 16, R, 2], tl.bfloat16)
    kp = tl.join(kb, kb) + kz
    kn = tl.join(-kb, -kb) + kz
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; prmt.b32 t, $1, $2, $3; shr.b32 t, t, $4; "
        "lop3.b32 t, t, 0x00030003, 0x3F803F80, 0xEA; fma.rn.bf16x2 $0, t, $5, $6; }",
        "=r,r,r,r,r,r,r", [wj, sj, kp, kn], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _rec_box(w0, w1, REC: tl.constexpr):
    """(lo, hi) fp32 from a record's box words (``sparq_records``): ``REC`` 1 bf16 (lo the low
    half of ``w0``: bf16 -> fp32 is a shift), 2 fp16, 3 fp32 (``w0``, ``w1``)."""
    if REC == 1:
        return (w0 << 16).to(tl.float32, bitcast=True), \
            (w0 & -65536).to(tl.float32, bitcast=True)
    elif REC == 2:
        return (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32), \
            (w0 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return w0.to(tl.float32, bitcast=True), w1.to(tl.float32, bitcast=True)


@triton.jit
def _rec_tile(rp, m3, REC: tl.constexpr, K: tl.constexpr, NW: tl.constexpr, R: tl.constexpr):
    """One aligned 16-byte load per record of the sub-tile (``rp`` [K, NW, R]: the records'
    first words, 4 words each) -> (lo, hi) fp32 and the code words 0, 1 [K, NW, R] (word 1
    only with two code words; split in registers)."""
    rec = tl.load(rp[:, :, :, None] + tl.arange(0, 4)[None, None, None, :],
                  mask=m3[:, :, :, None], other=0)                          # [K, NW, R, 4]
    even, odd = tl.split(tl.reshape(rec, (K, NW, R, 2, 2)))  # words (0, 2), (1, 3)
    r0, r2 = tl.split(even)
    r1, r3 = tl.split(odd)
    lo, hi = _rec_box(r0, r1, REC)
    if REC == 3:  # box in words 0 and 1, one code word (page 16)
        return lo, hi, r2, r3
    else:
        return lo, hi, r1, r2


@triton.jit
def rec_elem(page, ch, stride_page, stride_ch, RI: tl.constexpr):
    """Offset of element (``page``, channel ``ch``) of a record view (``sparq_records``: the
    records' box, code or width fields as [S, D] views, ``stride_page`` / ``stride_ch`` their
    un-interleaved strides) when the records are interleaved in chunks of ``RI`` pages
    (``rec_word``); ``RI`` 1: ``page * stride_page + ch * stride_ch``."""
    if RI == 1:
        return page * stride_page + ch * stride_ch
    else:
        return (page // RI) * (RI * stride_page) + (page % RI) * stride_ch + ch * (RI * stride_ch)


@triton.jit
def rec_word(page, ch, stride_page, RI: tl.constexpr):
    """Word offset of record (``page``, channel ``ch``) of 4 words (broadcast shapes): ``RI``
    1, the page's D records in its row (``stride_page`` words apart); ``RI`` > 1, records laid
    out in chunks of RI pages, channel-major within a chunk (``sparq_records.interleave``): one
    channel's records of a chunk's RI consecutive pages are contiguous, so a sub-tile of a
    chunk reads each chosen channel as one 16 x RI-byte run, not RI scattered 16-byte pieces
    of 64-byte DRAM bursts. ``stride_page`` is the un-interleaved row stride (D * 4)."""
    return rec_elem(page, ch, stride_page, 4, RI)


@triton.jit
def row_queries(q_row, stride_qh, ch_row, qk_scale, DT: tl.constexpr, G: tl.constexpr,
                GP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr,
                NWC: tl.constexpr):
    """A row's query operands, pre-scaled by ``qk_scale`` and in the dots' dtype: ``qt``
    [BLOCK_D, GP] (every channel), ``qc`` [R, GP] (the row's R channels ``ch`` [R] int64,
    also returned) and ``qbd`` [R * NWC, GP * NWC], ``qc`` block-diagonal over a channel's
    NWC code words (the tokens dot's K and N; module docstring, step 2)."""
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, R)
    g_ok = offs_g < G
    d_ok = offs_d < D
    qt = tl.load(q_row + offs_g[None, :] * stride_qh + offs_d[:, None],
                 mask=d_ok[:, None] & g_ok[None, :], other=0.0)
    qt = (qt.to(tl.float32) * qk_scale).to(DT)                                  # [BLOCK_D, GP]
    ch = tl.load(ch_row + offs_r).to(tl.int64)                                   # [R]
    qc = tl.load(q_row + offs_g[None, :] * stride_qh + ch[:, None], mask=g_ok[None, :],
                 other=0.0)
    qc = (qc.to(tl.float32) * qk_scale).to(DT)                                  # [R, GP]
    if NWC == 1:
        qbd = qc
    else:
        # K slot s of a channel holds word wslot(s) (the join tree's order); columns (g, s')
        ws = tl.arange(0, NWC)
        if NWC == 4:
            ws = 2 * (ws % 2) + ws // 2
        blk = ws[None, :, None, None] == tl.arange(0, NWC)[None, None, None, :]
        qbd = tl.reshape(tl.where(blk, qc[:, None, :, None], tl.zeros([R, NWC, GP, NWC], DT)),
                         (R * NWC, GP * NWC))
    return qt, qc, qbd, ch


@triton.jit
def subtile_words(codes_ptr, lo_ptr, hi_ptr, pg2, ch, m3, stride_lo, stride_hi, stride_codes,
                  REC: tl.constexpr, K: tl.constexpr, NW: tl.constexpr, R: tl.constexpr,
                  NWC: tl.constexpr, BCS: tl.constexpr, CCS: tl.constexpr,
                  RI: tl.constexpr = 1):
    """The sub-tile's loads: (lo, hi) [K, NW, R] (fp32 from records, else the summary dtype:
    exact either way), code words 0 and 1 [K, NW, R] (word 1 = word 0 when a channel has one)
    and the code words' pointers ``wp`` (words 2, 3 of page 64 are loaded by ``subtile_x``).
    ``pg2`` [K, NW] int64 page ids, ``ch`` [R] int64 channels, ``m3`` [K, NW, 1] mask."""
    if REC:  # whole records: box and code words in one vector load
        lo3, hi3, w0, w1 = _rec_tile(
            codes_ptr + rec_word(pg2[:, :, None], ch[None, None, :], stride_codes, RI), m3, REC,
            K, NW, R)
        wp = codes_ptr  # unused: 4-word records hold at most two code words
    else:
        lo3 = tl.load(lo_ptr + pg2[:, :, None] * stride_lo + ch[None, None, :] * BCS,
                      mask=m3, other=0.0)
        hi3 = tl.load(hi_ptr + pg2[:, :, None] * stride_hi + ch[None, None, :] * BCS,
                      mask=m3, other=0.0)                                 # [K, NW, R]
        wp = codes_ptr + pg2[:, :, None] * stride_codes + ch[None, None, :] * CCS
        w0 = tl.load(wp, mask=m3, other=0)
        w1 = w0
        if NWC > 1:
            w1 = tl.load(wp + 1, mask=m3, other=0)
    return lo3, hi3, w0, w1, wp


@triton.jit
def subtile_x(lo3, hi3, w0, w1, wp, m3, b3, qbd, magic, DT: tl.constexpr, K: tl.constexpr,
              NW: tl.constexpr, R: tl.constexpr, NWC: tl.constexpr, GP: tl.constexpr,
              SUB: tl.constexpr, ASM: tl.constexpr, FAST: tl.constexpr,
              DOT_PREC: tl.constexpr):
    """Steps 2-4 of the module docstring for one sub-tile of ``SUB`` pages (page k * NW + w on
    warp w): the decoded codes against the block-diagonal queries ``qbd``, plus the page
    terms ``b3`` [K, NW, GP], reduced over each page's tokens -> x [K, NW, GP] (log2 units).
    ``lo3`` / ``hi3`` [K, NW, R] in the dots' dtype ``DT``."""
    if NWC == 1:
        kk = ((hi3.to(tl.float32) - lo3.to(tl.float32)) * 2097152.0)[:, :, None, :]
        a = tl.reshape(_word_dev(w0, kk, magic, DT, FAST), (SUB * 16, R))
    elif NWC == 2:
        if ASM:
            dev = _word_pair_dev_bf16(w0, w1, lo3, hi3, K, NW, R)
        else:
            kk = ((hi3.to(tl.float32) - lo3.to(tl.float32)) * 2097152.0)[:, :, None, :]
            dev = tl.join(_word_dev(w0, kk, magic, DT, FAST), _word_dev(w1, kk, magic, DT, FAST))
        a = tl.reshape(dev, (SUB * 16, R * 2))
    else:
        kk = ((hi3.to(tl.float32) - lo3.to(tl.float32)) * 2097152.0)[:, :, None, :]
        d01 = tl.join(_word_dev(w0, kk, magic, DT, FAST), _word_dev(w1, kk, magic, DT, FAST))
        d23 = tl.join(_word_dev(tl.load(wp + 2, mask=m3, other=0), kk, magic, DT, FAST),
                      _word_dev(tl.load(wp + 3, mask=m3, other=0), kk, magic, DT, FAST))
        a = tl.reshape(tl.join(d01, d23), (SUB * 16, R * 4))
    xt = tl.dot(a, qbd, input_precision=DOT_PREC)                    # [SUB*16, GP*NWC]
    x5 = tl.reshape(xt, (K, NW, 16, GP, NWC)) + b3[:, :, None, :, None]
    mx = tl.max(tl.max(x5, axis=4), axis=2)                                 # [K, NW, GP]
    e = tl.sum(tl.sum(tl.exp2(x5 - mx[:, :, None, :, None]), axis=4), axis=2)
    return mx + log2_fast(e, FAST)


@triton.jit
def sparq_score_tiles(q_row, stride_qh, mean_ptr, lo_ptr, hi_ptr, codes_ptr, kscale_ptr, ch_row,
                      stride_mean, stride_lo, stride_hi, stride_codes, pt_row, s_row, stride_sg,
                      n, c0, c1, qk_scale, magic,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, PS: tl.constexpr, R: tl.constexpr,
                      BW: tl.constexpr, SUB: tl.constexpr, NW: tl.constexpr,
                      ASM: tl.constexpr, FAST: tl.constexpr, DOT_PREC: tl.constexpr,
                      BCS: tl.constexpr, CCS: tl.constexpr, REC: tl.constexpr,
                      RI: tl.constexpr = 1):
    """Score the full pages of chunks ``c0 .. c1`` (of BW pages) of one row: writes
    ``x_g = log2-sum-exp2 over the page's tokens of scale * log2(e) * logit_g`` to
    ``s_row[g, page]`` and returns the row's (max, sum of exp2(x - max)) per head [GP]
    (module docstring). ``q_row``: query head h * G; ``ch_row``: the row's R channels.

    Layouts (``sparq_records``): ``REC`` 0: boxes at ``lo_ptr`` / ``hi_ptr`` and code words at
    ``codes_ptr`` with channel strides ``BCS`` / ``CCS`` (1 and PS / 16 for the first layout;
    strided record views otherwise); ``REC`` > 0 (4-word records, the box kind
    ``sparq_records.rec_kind``): ``codes_ptr`` is the records, read whole (lo_ptr gives the
    dots' dtype only)."""
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
    for c in range(c0, c1):
        # 1. page terms of BW pages -> s_row
        offs_w = c * BW + tl.arange(0, BW)
        need = offs_w < n - 1  # full pages
        page = tl.load(pt_row + offs_w, mask=need, other=0).to(tl.int64)
        ks = tl.load(kscale_ptr + page, mask=need, other=0.0)
        mean = tl.load(mean_ptr + page[:, None] * stride_mean + offs_d[None, :],
                       mask=need[:, None] & d_ok[None, :], other=0)
        base = tl.dot(mean.to(DT), qt, input_precision=DOT_PREC) * ks[:, None]    # [BW, GP]
        mc = tl.load(mean_ptr + page[:, None] * stride_mean + ch[None, :], mask=need[:, None],
                     other=0)
        if REC:  # the records' box words (their sectors serve the codes below too)
            rp = codes_ptr + rec_word(page[:, None], ch[None, :], stride_codes, RI)
            b0 = tl.load(rp, mask=need[:, None], other=0)
            b1 = b0
            if REC == 3:
                b1 = tl.load(rp + 1, mask=need[:, None], other=0)
            lo, hi = _rec_box(b0, b1, REC)
        else:
            lo = tl.load(lo_ptr + page[:, None] * stride_lo + ch[None, :] * BCS,
                         mask=need[:, None], other=0.0).to(tl.float32)
            hi = tl.load(hi_ptr + page[:, None] * stride_hi + ch[None, :] * BCS,
                         mask=need[:, None], other=0.0).to(tl.float32)
        off = lo + 0.125 * (hi - lo) - mc.to(tl.float32) * ks[:, None]
        base = tl.dot(off.to(DT), qc, acc=base, input_precision=DOT_PREC)
        tl.store(s_row + offs_g[None, :] * stride_sg + offs_w[:, None], base,
                 mask=need[:, None] & g_ok[None, :])
        tl.debug_barrier()  # other warps read these page terms below
        # 2.-4. tokens, SUB pages at a time: page k * NW + w on warp w
        for sc in tl.static_range(BW // SUB):
            w2 = c * BW + sc * SUB + tl.arange(0, K)[:, None] * NW + tl.arange(0, NW)[None, :]
            ok2 = w2 < n - 1
            pg2 = tl.load(pt_row + w2, mask=ok2, other=0).to(tl.int64)            # [K, NW]
            b3 = tl.load(s_row + offs_g[None, None, :] * stride_sg + w2[:, :, None],
                         mask=ok2[:, :, None] & g_ok[None, None, :], other=0.0)   # [K, NW, GP]
            m3 = ok2[:, :, None]
            lo3, hi3, w0, w1, wp = subtile_words(
                codes_ptr, lo_ptr, hi_ptr, pg2, ch, m3, stride_lo, stride_hi, stride_codes,
                REC, K, NW, R, NWC, BCS, CCS, RI)
            x3 = subtile_x(lo3.to(DT), hi3.to(DT), w0, w1, wp, m3, b3, qbd, magic, DT, K, NW,
                           R, NWC, GP, SUB, ASM, FAST, DOT_PREC)
            offs_s = c * BW + sc * SUB + tl.arange(0, SUB)
            # (no barrier: x of a page follows its page term's read in the warp that owns it)
            tl.store(s_row + offs_g[None, :] * stride_sg + offs_s[:, None],
                     tl.reshape(x3, (SUB, GP)), mask=(offs_s < n - 1)[:, None] & g_ok[None, :])
            xm = tl.where(m3, x3, float("-inf"))
            m_new = tl.maximum(m_acc, xm)
            l_acc = l_acc * tl.exp2(m_acc - m_new) + tl.exp2(xm - m_new)
            m_acc = m_new
    m_run = tl.max(tl.max(m_acc, axis=1), axis=0)
    l_run = tl.sum(tl.sum(l_acc * tl.exp2(m_acc - m_run[None, None, :]), axis=1), axis=0)
    return m_run, l_run
