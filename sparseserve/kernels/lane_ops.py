"""Per-lane primitives for Triton kernels written one element per thread (tensors of
``N = num_warps * 32`` elements, element ``e`` being lane ``e % 32`` of warp ``e // 32``, the
layout Triton gives a 1-D tensor of that size): warp shuffles, 16-byte vector loads, byte
permutes, fp16 packing and the ``mma.sync.m16n8k16`` of fp16 fragments. With ``FAST`` (on the
GPU) each is inline PTX; without it (Triton's interpreter) each is emulated by gathers over the
lane axis with the hardware's semantics, so CPU tests run the kernels' fragment and bit
arithmetic. Used by ``sparq_lanes``."""
from __future__ import annotations

import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["lane_base", "shfl_idx", "shfl_f32", "shfl_xor", "ldg4", "ldg1_at",
           "byte_pair", "prmt", "f16x2", "half", "hmul2_half", "mma_m16n8k16"]


@triton.jit
def lane_base(N: tl.constexpr):
    """[N] the flat index of lane 0 of each element's warp."""
    e = tl.arange(0, N)
    return e - e % 32


@triton.jit
def shfl_idx(x, src, N: tl.constexpr, FAST: tl.constexpr):
    """int32 ``x`` of lane ``src`` [N] (0..31) of the same warp."""
    if FAST:
        return tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;",
                                         "=r,r,r", [x, src], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return tl.gather(x, lane_base(N) + src, axis=0)


@triton.jit
def shfl_f32(x, src, N: tl.constexpr, FAST: tl.constexpr):
    return shfl_idx(x.to(tl.int32, bitcast=True), src, N, FAST).to(tl.float32, bitcast=True)


@triton.jit
def shfl_xor(x, m: tl.constexpr, N: tl.constexpr, FAST: tl.constexpr):
    """fp32 ``x`` of lane ``lane ^ m``."""
    if FAST:
        return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;",
                                         "=f,f,r", [x, tl.full([N], m, tl.int32)],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        e = tl.arange(0, N)
        return tl.gather(x, e ^ m, axis=0)


@triton.jit
def ldg4(ptr, FAST: tl.constexpr):
    """Four int32 words at ``ptr`` [N] (16-byte aligned): one vector load a lane, not
    predicated (callers point pages they do not score at page 0, a valid row, and mask what
    follows from it: no predicate, no zeroing)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
            [ptr.to(tl.int64, bitcast=True)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)


@triton.jit
def ldg1_at(base, word, FAST: tl.constexpr):
    """The int32 word at ``base + word`` (``base`` an int32 pointer [N], ``word`` int32 [N]):
    one ``mad.wide`` and one 4-byte load, not predicated (as ``ldg4``)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "{ .reg .u64 a; mad.wide.s32 a, $2, 4, $1; ld.global.nc.b32 $0, [a]; }", "=r,l,r",
            [base.to(tl.int64, bitcast=True), word], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.load(base + word)


@triton.jit
def prmt(a, b, sel, FAST: tl.constexpr):
    """``prmt.b32``: byte ``k`` of the result is byte ``(sel >> 4 k) & 7`` of the 8 bytes
    ``b:a`` (0-3 ``a``'s, 4-7 ``b``'s); ``sel`` [N] int32 (sign-replication modes unused)."""
    if FAST:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = tl.zeros_like(a)
        for k in tl.static_range(4):
            i = (sel >> (4 * k)) & 7
            src = tl.where(i < 4, a, b)
            out = out | (((src >> (8 * (i % 4))) & 0xFF) << (8 * k))
        return out


@triton.jit
def byte_pair(a, b, ia, ib, FAST: tl.constexpr):
    """int32 with byte ``ia`` of ``a`` in bits 0-7 and byte ``ib`` of ``b`` in bits 16-23
    (``ia`` / ``ib`` 0..3, [N] or scalars; other bits unspecified: callers mask them)."""
    if FAST:
        sel = (tl.zeros_like(a) + ia) | ((tl.zeros_like(a) + ib + 4) << 8)
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return ((a >> (8 * ia)) & 0xFF) | (((b >> (8 * ib)) & 0xFF) << 16)


@triton.jit
def f16x2(lo, hi, FAST: tl.constexpr):
    """fp32 ``lo``, ``hi`` rounded to fp16 and packed (``lo`` in the low half)."""
    if FAST:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        lb = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hb = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lb | (hb << 16)


@triton.jit
def half(w, k):
    """fp32 value of half ``k`` (0 low, 1 high) of packed fp16 words ``w`` (emulation)."""
    return ((w >> (16 * k)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def hmul2_half(w, K: tl.constexpr, q, FAST: tl.constexpr):
    """Packed fp16 ``(w_K * q_lo, w_K * q_hi)``: half ``K`` (0 low, 1 high) of ``w`` times
    both halves of ``q``, each product rounded once to fp16 (``mul.rn.f16x2``)."""
    if FAST:
        if K == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 l, h; .reg .b32 b; mov.b32 {l, h}, $1; mov.b32 b, {l, l}; "
                "mul.rn.f16x2 $0, b, $2; }", "=r,r,r", [w, q], dtype=tl.int32, is_pure=True,
                pack=1)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 l, h; .reg .b32 b; mov.b32 {l, h}, $1; mov.b32 b, {h, h}; "
                "mul.rn.f16x2 $0, b, $2; }", "=r,r,r", [w, q], dtype=tl.int32, is_pure=True,
                pack=1)
    else:
        wk = half(w, K)  # fp16 x fp16 is exact in fp32: one rounding, as the hardware's
        return f16x2(wk * half(q, 0), wk * half(q, 1), FAST)


@triton.jit
def mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, N: tl.constexpr, FAST: tl.constexpr):
    """``mma.sync.m16n8k16.row.col.f32.f16.f16.f32`` of each warp: A / B fragments as packed
    fp16 int32 registers, C / D fp32 (the PTX fragment layouts: lane (gr, t) holds A rows
    gr / gr + 8 at K 2t, 2t + 1 (a0 / a1) and 2t + 8, 2t + 9 (a2 / a3), B K 2t, 2t + 1 (b0) and
    2t + 8, 2t + 9 (b1) of column gr, D rows gr (d0, d1) / gr + 8 (d2, d3) at columns 2t,
    2t + 1)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        e = tl.arange(0, N)
        lane = (e % 32)[:, None, None]
        base = (e - e % 32)[:, None, None]
        r = tl.arange(0, 4)[None, :, None]  # output register
        k = tl.arange(0, 16)[None, None, :]
        z = tl.zeros([N, 4, 16], tl.int32)
        row = lane // 4 + 8 * (r // 2) + z
        col = 2 * (lane % 4) + r % 2 + z
        # the registers stacked as join's order: register i at flat slot (i % 2) * 2 + i // 2
        A = tl.reshape(tl.join(tl.join(a0, a1), tl.join(a2, a3)), (N * 4,))
        B = tl.reshape(tl.join(b0, b1), (N * 2,))
        a_reg = row // 8 + 2 * (k // 8)
        a_src = (base + (row % 8) * 4 + (k % 8) // 2) * 4 + (a_reg % 2) * 2 + a_reg // 2
        b_src = (base + col * 4 + (k % 8) // 2) * 2 + k // 8
        kh = tl.reshape(k % 2 + z, (N * 64,))
        av = half(tl.gather(A, tl.reshape(a_src, (N * 64,)), axis=0), kh)
        bv = half(tl.gather(B, tl.reshape(b_src, (N * 64,)), axis=0), kh)
        d = tl.sum(tl.reshape(av * bv, (N, 4, 16)), axis=2)  # [N, 4]: registers 0..3
        d02, d13 = tl.split(tl.reshape(d, (N, 2, 2)))
        d0, d2 = tl.split(d02)
        d1, d3 = tl.split(d13)
        return c0 + d0, c1 + d1, c2 + d2, c3 + d3
