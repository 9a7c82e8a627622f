"""Page scores from key codes on a few channels per page (``sparse/keycode_channels.py``):
per query head, the log-sum-exp over a page's tokens of the approximate logits, in bound units
(``/ scale``); spec ``ref.channel_code_page_bounds``.

A token's approximate key is its page's mean except on the page's R coded channels, so its
logit is ``q . mean`` (one per page and head) plus ``q[chan] . dev_t`` with ``dev_t`` the coded
channels' decoded values minus the mean there. Grid (B, Hkv, cdiv(W, BLOCK_W)): a program
takes BLOCK_W pages; ``q . mean`` is one ``tl.dot`` of the [BLOCK_W, D] means against the
group's [D, GP] queries, the deviations one batched ``tl.dot`` of [BLOCK_W, PS, R] decoded
deviations against the [BLOCK_W, R, GP] queries gathered at each page's channels (L1-resident:
q is tiny). Each page's code words are read once as one contiguous row and unpacked by shifts
(token-major: word w, lane j is element w * 16 + j = token * R + channel), like
``code_scores.decode_page_keys``. Needs R >= 16 and a power of two (the dot's K); smaller R runs
the torch reference. Fixed grid, no host synchronisation.

Not measured on a GPU yet (written without one): BLOCK_W and warps are first guesses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import channel_codes_supported as supported
from . import patch_triton_interpreter
from .sparq_tiles import log2_fast

patch_triton_interpreter()

__all__ = ["channel_code_page_bounds", "chan_code_page_x"]

LOG2E = 1.4426950408889634


@triton.jit
def chan_code_page_x(mean_ptr, lo_ptr, hi_ptr, chan_ptr, codes_ptr, kscale_ptr, stride_mean,
                     stride_lo, stride_hi, stride_chan, stride_codes, q_row, stride_qh, qt, page,
                     ok, qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
                     PS: tl.constexpr, R: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                     INT8_MEAN: tl.constexpr, DOT_PREC: tl.constexpr,
                     FAST: tl.constexpr = False):
    """[BLOCK_W, GP] fp32: per head g, log2-sum-exp2 over each page's tokens of
    ``qk_scale * q_g . k^_t`` (``qk_scale`` = scale * log2 e) for the pages ``page`` [BLOCK_W]
    (int64; rows where ``ok`` is False read nothing). ``qt`` [BLOCK_D, GP]: the group's queries
    in the summary dtype, zero columns past G; ``q_row``: the pointer to query head h * G."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, GP)
    offs_r = tl.arange(0, R)
    m2 = ok[:, None] & (offs_d < D)[None, :]
    mean = tl.load(mean_ptr + page[:, None] * stride_mean + offs_d[None, :], mask=m2, other=0)
    mean = mean.to(tl.float32)
    if INT8_MEAN:
        mean = mean * tl.load(kscale_ptr + page, mask=ok, other=0.0)[:, None]
    base = tl.dot(mean.to(qt.dtype), qt, input_precision=DOT_PREC)        # [BLOCK_W, GP]
    # the coded channels [BLOCK_W, R]: four 8-bit indices per word
    r_ok = ok[:, None]
    cw = tl.load(chan_ptr + page[:, None] * stride_chan + tl.arange(0, R // 4)[None, :],
                 mask=r_ok, other=0)                                        # [BLOCK_W, R/4]
    ch = (cw[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 255
    ch = tl.reshape(ch, (BLOCK_W, R))
    lo = tl.load(lo_ptr + page[:, None] * stride_lo + offs_r[None, :], mask=r_ok, other=0.0)
    hi = tl.load(hi_ptr + page[:, None] * stride_hi + offs_r[None, :], mask=r_ok, other=0.0)
    lo = lo.to(tl.float32)
    hi = hi.to(tl.float32)
    mc = tl.load(mean_ptr + page[:, None] * stride_mean + ch, mask=r_ok, other=0).to(tl.float32)
    if INT8_MEAN:
        mc = mc * tl.load(kscale_ptr + page, mask=ok, other=0.0)[:, None]
    # 2-bit codes, token-major: NW words per page, 16 codes per word
    NW: tl.constexpr = PS * R // 16
    words = tl.load(codes_ptr + page[:, None] * stride_codes + tl.arange(0, NW)[None, :],
                    mask=r_ok, other=0)                                     # [BLOCK_W, NW]
    code = (words[:, :, None] >> (tl.arange(0, 16) * 2)[None, None, :]) & 3
    lev = (tl.reshape(code, (BLOCK_W, PS, R)).to(tl.float32) + 0.5) * 0.25
    dev = lo[:, None, :] + (hi - lo)[:, None, :] * lev - mc[:, None, :]     # [BLOCK_W, PS, R]
    # the group's queries at each page's channels [BLOCK_W, R, GP] (zero past G)
    qc = tl.load(q_row + offs_g[None, None, :] * stride_qh + ch[:, :, None],
                 mask=r_ok[:, :, None] & (offs_g < G)[None, None, :], other=0.0).to(qt.dtype)
    xt = tl.dot(dev.to(qt.dtype), qc, input_precision=DOT_PREC)           # [BLOCK_W, PS, GP]
    x3 = (xt + base[:, None, :]) * qk_scale
    mx = tl.max(x3, axis=1)
    return mx + log2_fast(tl.sum(tl.exp2(x3 - mx[:, None, :]), axis=1), FAST)


@triton.jit
def _chan_code_scores_kernel(
    q_ptr, mean_ptr, lo_ptr, hi_ptr, chan_ptr, codes_ptr, kscale_ptr, pt_ptr, np_ptr, out_ptr,
    stride_qb, stride_qh, stride_mean, stride_lo, stride_hi, stride_chan, stride_codes,
    stride_ptb, stride_pth, stride_npb, stride_ob, stride_oh, stride_og,
    W, qk_scale, inv_qk_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PS: tl.constexpr, R: tl.constexpr, BLOCK_W: tl.constexpr, INT8_MEAN: tl.constexpr,
    DOT_PREC: tl.constexpr,
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
    x = chan_code_page_x(mean_ptr, lo_ptr, hi_ptr, chan_ptr, codes_ptr, kscale_ptr, stride_mean,
                         stride_lo, stride_hi, stride_chan, stride_codes, q_row, stride_qh, qt,
                         page.to(tl.int64), w_ok, qk_scale, D, BLOCK_D, BLOCK_W, PS, R, G, GP,
                         INT8_MEAN, DOT_PREC)
    bound = tl.where(w_ok[:, None], x * inv_qk_scale, float("-inf"))     # bound units
    o = out_ptr + b64 * stride_ob + h * stride_oh + offs_g[None, :] * stride_og + offs_w[:, None]
    tl.store(o, bound, mask=(offs_w < W)[:, None] & (offs_g[None, :] < G))


def channel_code_page_bounds(q, kmean, klo, khi, chan, codes, page_table, num_pages,
                             kscale=None, out=None, block_w=16, num_warps=4):
    """Triton version of ``ref.channel_code_page_bounds`` (same arguments and result:
    [B, Hkv, G, W] float32). R = klo.shape[1] must pass ``kernels.channel_codes_supported``."""
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    G, R = Hq // Hkv, klo.shape[1]
    assert supported(R, D), f"{R} coded channels: use the reference"
    ps = codes.shape[1] * 16 // R
    assert ps * R == codes.shape[1] * 16 and ps & (ps - 1) == 0 and ps >= 16
    if not q.is_cuda and klo.dtype == torch.bfloat16:  # the interpreter's bf16 dot (triton#11584)
        q, klo, khi = q.float(), klo.float(), khi.float()
        kmean = kmean if kscale is not None else kmean.float()
    for t in (q, kmean, klo, khi, chan, codes):
        assert t.stride(-1) == 1
    assert chan.dtype == torch.int32 and codes.dtype == torch.int32
    int8 = kscale is not None
    ks = kscale.reshape(-1).contiguous() if int8 else klo  # any tensor when unused
    page_table = page_table.to(torch.int32).contiguous()
    num_pages = num_pages.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(B, Hkv, G, W, dtype=torch.float32, device=q.device)
    if B == 0 or W == 0:
        return out
    GP = max(16, triton.next_power_of_2(G))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    scale = D ** -0.5
    grid = (B, Hkv, triton.cdiv(W, block_w))
    _chan_code_scores_kernel[grid](
        q, kmean, klo, khi, chan, codes, ks, page_table, num_pages, out,
        q.stride(0), q.stride(1), kmean.stride(0), klo.stride(0), khi.stride(0), chan.stride(0),
        codes.stride(0), page_table.stride(0), page_table.stride(1), num_pages.stride(0),
        out.stride(0), out.stride(1), out.stride(2), W, scale * LOG2E, 1.0 / (scale * LOG2E),
        G=G, GP=GP, D=D, BLOCK_D=BLOCK_D, PS=ps, R=R, BLOCK_W=block_w, INT8_MEAN=int8,
        DOT_PREC="ieee" if klo.dtype == torch.float32 else "tf32", num_warps=num_warps)
    return out
