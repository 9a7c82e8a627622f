"""Per-page key summaries for page-scoring sparse algorithms (Quest, ArkVale).

One program per listed page: load the page's ``[page_size, D]`` key tile once, reduce the
valid rows to per-channel min / max (and ArkVale's cuboid radius), write the summary row —
or, for ArkVale, its box [c - r, c + r] directly (``box``: one launch where the min / max,
the radius and a torch epilogue took ~12).
Padding entries (page id < 0) write nothing. Fixed grid (N), no host synchronisation.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import patch_triton_interpreter
from .fused_layer_ops import _kind, _round_to

patch_triton_interpreter()

__all__ = ["update_page_summaries"]


@triton.jit
def _page_summary_kernel(
    k_ptr, ids_ptr, out_ptr, ntok_ptr, kmin_ptr, kmax_ptr, krad_ptr,
    stride_kp, stride_kt, stride_min, stride_max, stride_rad,
    D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_RADIUS: tl.constexpr, BOX: tl.constexpr, KIND: tl.constexpr, HAS_OUT: tl.constexpr,
):
    i = tl.program_id(0)
    page = tl.load(ids_ptr + i)
    n = tl.load(ntok_ptr + i)
    live = page >= 0
    page = tl.maximum(page, 0).to(tl.int64)
    row = page  # the summary row: the page's own, or the caller's write id
    if HAS_OUT:
        row = tl.maximum(tl.load(out_ptr + i), 0).to(tl.int64)
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = (offs_d < D) & live
    t_ok = offs_t < n
    mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + page * stride_kp + offs_t[:, None] * stride_kt + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)                        # [PAGE_SIZE, BLOCK_D]
    mn = tl.min(tl.where(mask, k, float("inf")), axis=0)                    # [BLOCK_D]
    mx = tl.max(tl.where(mask, k, float("-inf")), axis=0)                   # [BLOCK_D]
    if not BOX:
        tl.store(kmin_ptr + row * stride_min + offs_d, mn.to(kmin_ptr.dtype.element_ty),
                 mask=d_ok)
        tl.store(kmax_ptr + row * stride_max + offs_d, mx.to(kmax_ptr.dtype.element_ty),
                 mask=d_ok)
    if HAS_RADIUS or BOX:
        c = (tl.where(d_ok, mn, 0.0) + tl.where(d_ok, mx, 0.0)) * 0.5   # dead rows: no inf - inf
        dev = tl.where(mask, tl.abs(c[None, :] - k), 0.0)
        r = tl.sum(dev, axis=0) / tl.maximum(n, 1).to(tl.float32)
        if BOX:
            # the roundings of the two-step form: min, max and radius stored in the summary
            # dtype, then c = (min + max) / 2 and c -/+ r in fp32, stored (round-to-nearest-
            # even by _round_to: the same bits compiled and in the interpreter)
            dt = kmin_ptr.dtype.element_ty
            cb = (_round_to(mn, KIND) + _round_to(mx, KIND)) * 0.5
            rb = _round_to(r, KIND)
            tl.store(kmin_ptr + row * stride_min + offs_d, _round_to(cb - rb, KIND).to(dt),
                     mask=d_ok)
            tl.store(kmax_ptr + row * stride_max + offs_d, _round_to(cb + rb, KIND).to(dt),
                     mask=d_ok)
        else:
            # per entry, not per summary row: the caller's buffer is [N, D] (see the wrapper)
            tl.store(krad_ptr + i * stride_rad + offs_d, r.to(krad_ptr.dtype.element_ty),
                     mask=d_ok)


def update_page_summaries(k_cache, page_ids, num_tokens, kmin, kmax, kradius=None,
                          box: bool = False, write_ids=None) -> None:
    """(Re)compute per-page key summaries in place.

    Args:
        k_cache:    [P, page_size, D]  K pages of this layer (last dim contiguous)
        page_ids:   [N] int32          pages whose summary to compute; entries < 0 are padding
                                       and skipped; valid ids must be unique
        num_tokens: [N] int32          valid tokens in each page (1..page_size)
        kmin, kmax: [S, D]             per-channel min / max of the page's valid keys, written at
                                       row page_ids[i] (S >= P); other rows untouched
        kradius:    [N, D] or None     ArkVale cuboid radius of entry i (row i, not the page's
                                       row: a per-call buffer, so a captured step owns it):
                                       mean over valid tokens t of |c - k_t| with
                                       c = (kmin + kmax) / 2; padding entries' rows untouched
        box:        ArkVale's box instead (kradius must be None): kmin / kmax rows get
                    c - r / c + r, with min, max and r first rounded to the summary dtype
                    (bit-equal to writing min / max / radius, then that epilogue in torch)
        write_ids:  [N] int32/int64 or None: the summary row of entry i (default page_ids[i]):
                    a page read where it lies (a device slot) summarised at another row
                    (its host page id); unique where page_ids >= 0
    Summaries are computed in fp32 and stored in the summary tensors' dtype.
    """
    P, page_size, D = k_cache.shape
    (N,) = page_ids.shape
    assert num_tokens.shape == (N,)
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    assert k_cache.stride(2) == 1 and kmin.stride(1) == 1 and kmax.stride(1) == 1
    assert page_ids.is_contiguous() and num_tokens.is_contiguous()
    if N == 0:
        return
    has_radius = kradius is not None
    assert not (box and has_radius), "box writes the box itself: no radius buffer"
    if has_radius:
        assert kradius.stride(1) == 1
    krad = kradius if has_radius else kmin
    BLOCK_D = max(16, triton.next_power_of_2(D))
    # one warp per page: 2.4 TB/s on an H200 at page 32 x D 128 bf16 (4 warps: 0.56 TB/s)
    has_out = write_ids is not None
    if has_out:
        assert write_ids.shape == (N,) and write_ids.is_contiguous()
    _page_summary_kernel[(N,)](
        k_cache, page_ids, write_ids if has_out else page_ids, num_tokens, kmin, kmax, krad,
        k_cache.stride(0), k_cache.stride(1), kmin.stride(0), kmax.stride(0), krad.stride(0),
        D=D, PAGE_SIZE=page_size, BLOCK_D=BLOCK_D,
        HAS_RADIUS=has_radius, BOX=box, KIND=_kind(kmin) if box else 0, HAS_OUT=has_out,
        num_warps=max(1, min(8, page_size * BLOCK_D // 4096)),
        enable_fp_fusion=False)
