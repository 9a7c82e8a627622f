"""Paged decode attention over per-KV-head pages (dense and sparse decode share it).

One program per (request, KV head[, split]) handles all ``G = Hq // Hkv`` query heads of the
group together: q is a ``[BLOCK_G, D]`` tile (G padded to >= 16 for ``tl.dot``), each loop
iteration gathers ``BLOCK_N`` tokens (``BLOCK_N // page_size`` pages) of K and V as
``[BLOCK_N, D]`` tiles (rows contiguous along D, so loads vectorise), and an online softmax
(base-2, fp32) runs over the page list.

Split-K (flash-decoding): for long page lists the W entries are cut into ``num_splits``
contiguous ranges, one program each; every program writes its partial (max, sum, acc) to an
fp32 workspace and a second small kernel merges them. ``num_splits`` is a function of shapes
only (``default_num_splits(B, Hkv, W)``), never of data, so the launch is CUDA-graph capturable:
enough splits that ``B * Hkv * num_splits`` fills the GPU (about 8 programs per SM), never more
than one loop iteration's worth of pages per split, at most ``MAX_SPLITS``. Measured on an H200
(bf16, Hq=32, Hkv=8, D=128, page 32; copy ceiling 4.2 TB/s): B=1 x 131k tokens 140 us
(3.8 TB/s, 64 splits; 3.2 ms unsplit); B=8 x 32k 264 us (4.1 TB/s; 841 us unsplit); B=1 x 64
selected pages 28 us GPU time (32 splits; 58 us unsplit); B=64 / 256 x 64 pages unsplit 3.9 / 4.3
TB/s, where splitting would cost 5-10%. Pass ``num_splits`` explicitly for results that
do not depend on the batch size (batch invariance).

Everything has fixed shapes and no host synchronisation: num_pages / last_page_len are read
inside the kernel, loop bounds are device values.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["paged_decode_attention", "default_num_splits", "MAX_SPLITS", "PROGRAMS_PER_SM"]

MAX_SPLITS = 64        # upper bound on splits per (request, KV head)
PROGRAMS_PER_SM = 8    # split until B * Hkv * num_splits reaches this many programs per SM
NO_SPLIT_PER_SM = 3    # ... unless B * Hkv alone already gives this many programs per SM
_DEFAULT_SMS = 132     # H100 / H200 SXM; used off-GPU (interpreter)
# the merge's split tile is sized for the most splits, not the step's: a constexpr that
# followed the split count would compile a merge variant per power of two mid-serving
_MERGE_BLOCK_S = 1 << (MAX_SPLITS - 1).bit_length()  # next power of two >= MAX_SPLITS
_LOG2E = 1.4426950408889634


def default_num_splits(batch: int, num_kv_heads: int, W: int, pages_per_iter: int = 1,
                       num_sms: int = _DEFAULT_SMS) -> int:
    """Split-K programs per (request, KV head): a function of shapes only.

    1 when ``batch * num_kv_heads >= NO_SPLIT_PER_SM * num_sms``; otherwise
    ``num_sms * PROGRAMS_PER_SM // (batch * num_kv_heads)``, capped by ``MAX_SPLITS`` and by
    ``cdiv(W, pages_per_iter)`` (each split gets at least one loop iteration). The workspace is
    therefore bounded by ``num_sms * PROGRAMS_PER_SM`` rows whatever the batch.
    """
    programs = max(1, batch * num_kv_heads)
    if programs >= NO_SPLIT_PER_SM * num_sms:
        return 1
    want = max(1, num_sms * PROGRAMS_PER_SM // programs)
    return max(1, min(want, MAX_SPLITS, triton.cdiv(W, pages_per_iter)))


@functools.lru_cache(maxsize=None)
def _sms_of_cuda_device(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sms_of_cuda_device(index)


# Outside CUDA graphs (hybrid steps, eager decode) the page table's width, the split size and
# the metadata's place in its packed buffer change from step to step: not specialised on
# (== 1, % 16, 16-byte alignment), else a new class compiles mid-serving (0.45 s on the H200,
# serving.md twentieth session). They only index per-page loads; K/V strides stay specialised.
@triton.jit(do_not_specialize=["stride_ptb", "stride_pth", "stride_npb", "pages_per_split"],
            do_not_specialize_on_alignment=["pt_ptr", "np_ptr", "lpl_ptr"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, np_ptr, lpl_ptr, o_ptr,
    ml_ptr,                      # [B, Hkv, NS, 2, BLOCK_G] fp32 workspace (split mode only)
    qk_scale,                    # scale * log2(e)
    stride_qb, stride_qh,
    stride_kp, stride_kt,
    stride_vp, stride_vt,
    stride_ptb, stride_pth,
    stride_npb,
    stride_ob, stride_oh,        # out (non-split) or partial acc [B, Hkv, NS, BLOCK_G, D]
    stride_os,                   # split stride of partial acc (split mode only)
    Hkv, pages_per_split,
    G: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s_id = tl.program_id(2)
    PAGES_PER_ITER: tl.constexpr = BLOCK_N // PAGE_SIZE

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < D
    slot = offs_n // PAGE_SIZE          # which page of this iteration a token row belongs to
    tok = offs_n % PAGE_SIZE            # token inside its page

    b64 = b.to(tl.int64)
    q_ptrs = q_ptr + b64 * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)        # [BLOCK_G, BLOCK_D]

    n = tl.load(np_ptr + b * stride_npb + h)
    last_len = tl.load(lpl_ptr + b)
    start = s_id * pages_per_split
    end = tl.minimum(n, start + pages_per_split)
    pt_row = pt_ptr + b64 * stride_ptb + h * stride_pth

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for p0 in range(start, end, PAGES_PER_ITER):
        entry = p0 + slot                                                       # [BLOCK_N]
        in_list = entry < end
        page = tl.load(pt_row + entry, mask=in_list, other=0).to(tl.int64)
        tok_ok = in_list & ((entry < n - 1) | (tok < last_len))
        ld_mask = tok_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + tok[:, None] * stride_kt + offs_d[None, :],
                    mask=ld_mask, other=0.0)                                    # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale    # [BLOCK_G, BLOCK_N]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))   # finite: every iteration has >= 1 valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + page[:, None] * stride_vp + tok[:, None] * stride_vt + offs_d[None, :],
                    mask=ld_mask, other=0.0)                                    # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # partial results of split s_id: acc (unnormalised), m (log2 domain), l
        row = (b64 * Hkv + h) * tl.num_programs(2) + s_id
        o_ptrs = o_ptr + row * stride_os + offs_g[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + row * (2 * BLOCK_G) + offs_g, m_i, mask=g_ok)
        tl.store(ml_ptr + row * (2 * BLOCK_G) + BLOCK_G + offs_g, l_i, mask=g_ok)
    else:
        o = acc / l_i[:, None]
        o_ptrs = o_ptr + b64 * stride_ob + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["NS"])  # the split count follows the step's widest row
def _merge_splits_kernel(
    acc_ptr, ml_ptr, o_ptr,
    stride_ob, stride_oh,
    Hkv, NS,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (request, query head): merge the NS partial results."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // G
    g = hq % G
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NS
    rows = (b.to(tl.int64) * Hkv + h) * NS + offs_s                             # [BLOCK_S]
    m = tl.load(ml_ptr + rows * (2 * BLOCK_G) + g, mask=s_ok, other=float("-inf"))
    l = tl.load(ml_ptr + rows * (2 * BLOCK_G) + BLOCK_G + g, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)                    # finite: split 0 always holds entry 0
    w = tl.exp2(m - m_max)                       # empty splits: exp2(-inf) = 0
    acc = tl.load(acc_ptr + (rows[:, None] * BLOCK_G + g) * D + offs_d[None, :],
                  mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)        # [BLOCK_S, BLOCK_D]
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh + offs_d,
             o.to(o_ptr.dtype.element_ty), mask=offs_d < D)


def _launch_config(page_size: int, block_d: int):
    """(BLOCK_N, num_warps, num_stages) for the main kernel."""
    block_n = max(64 if block_d > 64 else 128, page_size)
    return block_n, 4, 2


def paged_decode_attention(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale,
                           out=None, *, num_splits=None, config=None):
    """Decode attention (one query token per request) over a list of KV pages per KV head.

    Args:
        q:             [B, Hq, D]          one decode query per request, Hq = Hkv * G
        k_cache:       [P, page_size, D]   physical K pages of this layer
        v_cache:       [P, page_size, D]   physical V pages of this layer
        page_table:    [B, Hkv, W] int32   physical page ids to attend, any order, except that the
                                           request's partial last page, if included, is entry
                                           ``num_pages[b, h] - 1``; entries >= num_pages are ignored
                                           (may hold garbage)
        num_pages:     [B, Hkv] int32      valid entries of page_table[b, h] (1..W)
        last_page_len: [B] int32           tokens valid in entry num_pages[b, h] - 1 (1..page_size);
                                           all other valid entries are full pages
        scale:         float               softmax scale
        out:           [B, Hq, D] or None  written in place if given (last dim contiguous)
        num_splits:    int or None         split-K programs per (request, KV head); None =
                                           ``default_num_splits(B, Hkv, W, ...)``;
                                           1 = single-pass kernel (no workspace)
        config:        (block_n, num_warps, num_stages) or None: launch override for tuning;
                                           block_n = tokens per loop iteration (a multiple of
                                           page_size)
    Returns:
        out: [B, Hq, D] in q's dtype = softmax(scale * q K^T) V over the selected tokens,
        accumulated in fp32.

    Requirements: q, k_cache, v_cache, out have a contiguous last dim; page_size is a power of
    two; D <= 256; all tensors on one device. ``last_page_len`` is per request, so a request's
    partial last page must be selected for all of its KV heads or none (then pass page_size).
    The split path allocates an fp32 workspace of
    ``B * Hkv * num_splits * max(16, next_pow2(G)) * (D + 2)`` floats inside the call (under
    CUDA-graph capture it comes from the graph's private pool; no caller preallocation needed).
    """
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    page_size = k_cache.shape[1]
    assert Hq % Hkv == 0, "Hq must be a multiple of Hkv"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == D
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert page_table.stride(2) == 1 and num_pages.stride(1) == 1
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    BLOCK_G = max(16, triton.next_power_of_2(G))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N, num_warps, num_stages = config or _launch_config(page_size, BLOCK_D)
    assert BLOCK_N % page_size == 0
    if num_splits is None:
        ns = default_num_splits(B, Hkv, W, BLOCK_N // page_size, _num_sms(q.device))
    else:
        ns = max(1, min(int(num_splits), W, MAX_SPLITS))  # the merge tile holds MAX_SPLITS
    pages_per_split = triton.cdiv(W, ns)
    # round to whole iterations so only the last split has a ragged tail
    pages_per_split = triton.cdiv(pages_per_split, BLOCK_N // page_size) * (BLOCK_N // page_size)
    ns = triton.cdiv(W, pages_per_split)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale = float(scale) * _LOG2E
    common = dict(G=G, D=D, PAGE_SIZE=page_size, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D,
                  BLOCK_N=BLOCK_N, DOT_PRECISION=dot_precision,
                  num_warps=num_warps, num_stages=num_stages)
    args = (q, k_cache, v_cache, page_table, num_pages, last_page_len)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
               v_cache.stride(0), v_cache.stride(1), page_table.stride(0), page_table.stride(1),
               num_pages.stride(0))
    if ns == 1:
        _paged_decode_kernel[(B, Hkv, 1)](
            *args, out, out, qk_scale, *strides, out.stride(0), out.stride(1), 0,
            Hkv, W, SPLIT=False, **common)
        return out
    acc = torch.empty(B, Hkv, ns, BLOCK_G, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(B, Hkv, ns, 2, BLOCK_G, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(B, Hkv, ns)](
        *args, acc, ml, qk_scale, *strides, 0, acc.stride(3), acc.stride(2),
        Hkv, pages_per_split, SPLIT=True, **common)
    _merge_splits_kernel[(B, Hq)](
        acc, ml, out, out.stride(0), out.stride(1), Hkv, ns,
        G=G, D=D, BLOCK_G=BLOCK_G, BLOCK_S=_MERGE_BLOCK_S,
        BLOCK_D=BLOCK_D, num_warps=4)
    return out
