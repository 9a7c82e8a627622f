"""Page scores from token-level key codes (``sparse/keycodes.py``): per query head, the
log-sum-exp over a page's tokens of the approximate logits ``q · k^_t``, in bound units
(``/ scale``), so that ``ref.mass_from_bounds`` of it is the approximate token attention mass
summed per page.

Grid (B, Hkv, cdiv(W, BLOCK_W)): a program decodes the ``BLOCK_W * page_size`` approximate
keys of ``BLOCK_W`` pages (``k^ = kmin + (kmax - kmin) * level(code)``, the code's word read
per element: same-word lanes hit the cache), one ``tl.dot`` against the group's ``[D, GP]``
queries gives every head's logits, and a per-page max / sum-of-exp2 reduces them. Entries past
``num_pages`` read nothing and get -inf. Fixed grid, no host synchronisation. Spec:
``ref.code_page_bounds``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter
from .sparq_tiles import log2_fast

patch_triton_interpreter()

__all__ = ["code_page_bounds", "decode_page_keys", "code_page_x"]

LOG2E = 1.4426950408889634


@triton.jit
def decode_page_keys(kmin_ptr, kmax_ptr, codes_ptr, stride_min, stride_max, stride_codes,
                     page, ok, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
                     PS: tl.constexpr, BITS: tl.constexpr):
    """[BLOCK_W * PS, BLOCK_D] fp32 approximate keys ``kmin + (kmax - kmin) * level(code)``
    of the pages ``page`` [BLOCK_W] (int64; rows where ``ok`` is False read nothing: zeros).

    With D a power of two each page's code words are read once, as one contiguous row of
    ``PS * D * BITS / 32`` words, unpacked by shifts, and the box is read once per page and
    broadcast over its tokens. (The per-element path below, kept for other head sizes, reads
    a word per element and the box per token: 16x and 32x the load instructions, measured at
    2 % of copy bandwidth on the H200.)"""
    T: tl.constexpr = BLOCK_W * PS
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == D:
        PER: tl.constexpr = 32 // BITS
        NWP: tl.constexpr = PS * D * BITS // 32
        offs_n = tl.arange(0, NWP)
        words = tl.load(codes_ptr + page[:, None] * stride_codes + offs_n[None, :],
                        mask=ok[:, None], other=0)                           # [BLOCK_W, NWP]
        shift = tl.arange(0, PER) * BITS
        code = (words[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)
        code = tl.reshape(code, (BLOCK_W, PS, D))  # word w, lane j = element w * PER + j
        if BITS == 1:
            lev = code.to(tl.float32)
        else:
            lev = (code.to(tl.float32) + 0.5) * (1.0 / (1 << BITS))
        m2 = ok[:, None]
        lo = tl.load(kmin_ptr + page[:, None] * stride_min + offs_d[None, :], mask=m2,
                     other=0.0).to(tl.float32)                              # [BLOCK_W, D]
        hi = tl.load(kmax_ptr + page[:, None] * stride_max + offs_d[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        kh = lo[:, None, :] + (hi - lo)[:, None, :] * lev
        return tl.reshape(kh, (T, BLOCK_D))
    else:
        offs_r = tl.arange(0, T)
        tok = offs_r % PS
        rpage = tl.reshape(tl.broadcast_to(page[:, None], (BLOCK_W, PS)), (T,))
        r_ok = tl.reshape(tl.broadcast_to(ok[:, None], (BLOCK_W, PS)), (T,))
        m2 = r_ok[:, None] & (offs_d < D)[None, :]
        lo = tl.load(kmin_ptr + rpage[:, None] * stride_min + offs_d[None, :], mask=m2,
                     other=0.0).to(tl.float32)                              # [T, BLOCK_D]
        hi = tl.load(kmax_ptr + rpage[:, None] * stride_max + offs_d[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        f = (tok[:, None] * D + offs_d[None, :]) * BITS                     # code bit offset
        word = tl.load(codes_ptr + rpage[:, None] * stride_codes + f // 32, mask=m2, other=0)
        code = (word >> (f % 32)) & ((1 << BITS) - 1)  # low bits: any shift kind
        if BITS == 1:
            lev = code.to(tl.float32)
        else:
            lev = (code.to(tl.float32) + 0.5) * (1.0 / (1 << BITS))
        return lo + (hi - lo) * lev


@triton.jit
def code_page_x(kmin_ptr, kmax_ptr, codes_ptr, stride_min, stride_max, stride_codes, pt_row,
                w0, n, qt, qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_W: tl.constexpr, PS: tl.constexpr, BITS: tl.constexpr,
                GP: tl.constexpr, DOT_PREC: tl.constexpr, FAST: tl.constexpr = False):
    """[BLOCK_W, GP] per head: log2-sum-exp2 over each full page's tokens of the scaled
    approximate logits (key codes, ``ref.code_page_bounds`` times scale * log2 e): the score
    phase of ``page_select.select_pages(..., codes=, bits=)``, pages ``w0 ..`` of a row."""
    offs_w = w0 + tl.arange(0, BLOCK_W)
    ok = offs_w < n - 1  # full pages
    page = tl.load(pt_row + offs_w, mask=ok, other=0).to(tl.int64)
    kh = decode_page_keys(kmin_ptr, kmax_ptr, codes_ptr, stride_min, stride_max, stride_codes,
                          page, ok, D, BLOCK_D, BLOCK_W, PS, BITS)          # [T, BLOCK_D]
    # the dot in the summary dtype (tensor cores for 16-bit KV; exact IEEE for fp32): the
    # rounding of a decoded 2-bit key to bf16 is far below its quantisation error
    xt = tl.dot(kh.to(qt.dtype), qt, input_precision=DOT_PREC) * qk_scale   # [T, GP] fp32
    x3 = tl.reshape(xt, (BLOCK_W, PS, GP))
    mx = tl.max(x3, axis=1)
    return mx + log2_fast(tl.sum(tl.exp2(x3 - mx[:, None, :]), axis=1), FAST)


@triton.jit
def _code_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, codes_ptr, pt_ptr, np_ptr, out_ptr,
    stride_qb, stride_qh, stride_min, stride_max, stride_codes,
    stride_ptb, stride_pth, stride_npb, stride_ob, stride_oh, stride_og,
    W, qk_scale2, inv_scale2,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PS: tl.constexpr, BITS: tl.constexpr, BLOCK_W: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    wb = tl.program_id(2)
    b64 = b.to(tl.int64)
    n = tl.load(np_ptr + b * stride_npb + h)
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, GP)
    d_ok = offs_d < D
    offs_w = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = offs_w < n
    page = tl.load(pt_ptr + b64 * stride_ptb + h * stride_pth + offs_w, mask=w_ok, other=0)
    kh = decode_page_keys(kmin_ptr, kmax_ptr, codes_ptr, stride_min, stride_max, stride_codes,
                          page.to(tl.int64), w_ok, D, BLOCK_D, BLOCK_W, PS, BITS)  # [T, BLOCK_D]
    qm = d_ok[:, None] & (offs_g[None, :] < G)
    qt = tl.load(q_ptr + b64 * stride_qb + (h * G + offs_g[None, :]) * stride_qh
                 + offs_d[:, None], mask=qm, other=0.0).to(kmax_ptr.dtype.element_ty)
    # the dot in the summary dtype: tensor cores for 16-bit KV, exact IEEE for fp32
    x = tl.dot(kh.to(qt.dtype), qt, input_precision=DOT_PREC) * qk_scale2  # [T, GP] log2
    x3 = tl.reshape(x, (BLOCK_W, PS, GP))
    mx = tl.max(x3, axis=1)                                                 # [BLOCK_W, GP]
    lse2 = mx + tl.log2(tl.sum(tl.exp2(x3 - mx[:, None, :]), axis=1))
    bound = lse2 * inv_scale2                                               # bound units
    bound = tl.where(w_ok[:, None], bound, float("-inf"))
    o = out_ptr + b64 * stride_ob + h * stride_oh + offs_g[None, :] * stride_og + offs_w[:, None]
    tl.store(o, bound, mask=(offs_w < W)[:, None] & (offs_g[None, :] < G))


def code_page_bounds(q, kmin, kmax, codes, page_table, num_pages, bits, out=None):
    """Per-query-head page scores from key codes; see ``ref.code_page_bounds``.

    q [B, Hq, D], kmin/kmax [S, D], codes [S, page_size * D * bits / 32] int32,
    page_table [B, Hkv, W] int32, num_pages [B, Hkv] int32 -> [B, Hkv, G, W] float32."""
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    G = Hq // Hkv
    if not q.is_cuda and kmax.dtype == torch.bfloat16:  # the interpreter's bf16 dot (triton#11584)
        q, kmin, kmax = q.float(), kmin.float(), kmax.float()
    ps = codes.shape[1] * 32 // (bits * D)
    assert ps * D * bits == codes.shape[1] * 32 and ps & (ps - 1) == 0
    assert q.stride(2) == 1 and kmin.stride(1) == 1 and kmax.stride(1) == 1
    assert codes.stride(1) == 1 and codes.dtype == torch.int32
    page_table = page_table.to(torch.int32).contiguous()
    num_pages = num_pages.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(B, Hkv, G, W, dtype=torch.float32, device=q.device)
    if B == 0 or W == 0:
        return out
    GP = max(16, triton.next_power_of_2(G))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    block_w = max(1, min(16, 8192 // (ps * BLOCK_D)))  # ~8k decoded elements per tile
    block_w = triton.next_power_of_2(block_w)
    scale = D ** -0.5
    grid = (B, Hkv, triton.cdiv(W, block_w))
    _code_scores_kernel[grid](
        q, kmin, kmax, codes, page_table, num_pages, out,
        q.stride(0), q.stride(1), kmin.stride(0), kmax.stride(0), codes.stride(0),
        page_table.stride(0), page_table.stride(1), num_pages.stride(0),
        out.stride(0), out.stride(1), out.stride(2), W, scale * LOG2E, 1.0 / (scale * LOG2E),
        G=G, GP=GP, D=D, BLOCK_D=BLOCK_D, PS=ps, BITS=bits, BLOCK_W=block_w,
        DOT_PREC="ieee" if kmax.dtype == torch.float32 else "tf32", num_warps=4)
    return out
