"""Fused page selection for the summary-box algorithms (Quest, ArkVale): score + kept pages +
top-k + compaction in Triton, replacing ``SparseAlgorithm.select``'s score kernel, ~25 torch ops
and ``torch.topk`` (the measured bottleneck of sparse decode).

One (request, KV head) row at a time:

1. Score. ``max(q M, q m) = q+ M + q- m`` whenever ``M >= m`` (true for a min/max box and for
   ArkVale's ``c -/+ r`` box), so the group's sum is ``P . M + N . m`` with ``P = sum_g q_g+``
   and ``N = sum_g q_g-`` formed once: two FMAs per summary element whatever the GQA group size
   (the literal formula costs ~4G ops). Scores become order-preserving int32 keys in a scratch
   row: kept pages INT_MAX, the last page and entries past ``num_pages`` INT_MIN.
2. Threshold. Binary search over the 2^32 key values for T = the k-th largest key
   (``count(key >= T) >= k > count(key > T)``): 32 block-wide counts over the row, held in
   registers when W <= ``MAX_TILE`` (else re-read from the scratch row, L2-resident).
3. Compact. Keys > T and the first ``k - count(> T)`` keys == T in block order (deterministic
   ties) are written in block order by a prefix sum; the last page follows at ``num_sel - 1``.

Fused mode runs all three in one program per (request, KV head). With few rows (small batch)
one program per row cannot pull the summaries fast enough, so split mode scores with
``num_splits`` programs per row and selects in a second launch of the same kernel.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["select_pages", "MAX_TILE"]

MAX_TILE = 8192  # widest key row held in registers (32 int32 per thread at 8 warps)
# Untuned defaults (no GPU was at hand when written); None = the heuristics in select_pages.
# Set here or by environment to sweep them without code changes.
NUM_SPLITS = int(os.environ.get("SPARSESERVE_SELECT_SPLITS", 0)) or None
BLOCK_W = int(os.environ.get("SPARSESERVE_SELECT_BLOCK_W", 0)) or None
NUM_WARPS = int(os.environ.get("SPARSESERVE_SELECT_WARPS", 0)) or None
SPLIT_PROGRAMS_PER_SM = 2  # split mode until rows alone give this many programs per SM


@triton.jit
def _page_select_kernel(
    q_ptr, kmin_ptr, kmax_ptr, pt_ptr, np_ptr, key_ptr, pages_ptr, blocks_ptr, nsel_ptr,
    stride_qb, stride_qh, stride_min, stride_max, stride_ptb, stride_pth, stride_npb,
    stride_kb, stride_kh, stride_pb, stride_ph, stride_bb, stride_bh, stride_nb,
    W, k_top, k_out, sink, local, chunks_per_split,
    G: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, ONE_TILE: tl.constexpr, BLOCK_K: tl.constexpr,
    DO_SCORE: tl.constexpr, DO_SELECT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    n = tl.load(np_ptr + b * stride_npb + h)
    pt_row = pt_ptr + b64 * stride_ptb + h * stride_pth
    key_row = key_ptr + b64 * stride_kb + h * stride_kh
    if DO_SCORE:
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        qp = tl.zeros([BLOCK_D], tl.float32)
        qn = tl.zeros([BLOCK_D], tl.float32)
        for g in tl.static_range(G):
            qg = tl.load(q_ptr + b64 * stride_qb + (h * G + g) * stride_qh + offs_d, mask=d_ok,
                         other=0.0).to(tl.float32)
            qp += tl.maximum(qg, 0.0)
            qn += tl.minimum(qg, 0.0)
        c0 = tl.program_id(2) * chunks_per_split
        c1 = tl.minimum(c0 + chunks_per_split, tl.cdiv(W, BLOCK_W))
        for c in range(c0, c1):
            offs_w = c * BLOCK_W + tl.arange(0, BLOCK_W)
            cand = offs_w < n - 1  # the last page is appended separately
            kept = cand & ((offs_w < sink) | (offs_w >= n - local))
            need = cand & (~kept)  # kept pages need no score: skip their summary reads
            page = tl.load(pt_row + offs_w, mask=need, other=0).to(tl.int64)
            m2 = need[:, None] & d_ok[None, :]
            hi = tl.load(kmax_ptr + page[:, None] * stride_max + offs_d[None, :], mask=m2,
                         other=0.0).to(tl.float32)                          # [BLOCK_W, BLOCK_D]
            lo = tl.load(kmin_ptr + page[:, None] * stride_min + offs_d[None, :], mask=m2,
                         other=0.0).to(tl.float32)
            score = tl.sum(hi * qp[None, :] + lo * qn[None, :], axis=1)      # [BLOCK_W]
            # float -> int32 with the same order: negatives flip their magnitude bits
            bits = score.to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            key = tl.maximum(key, -2147483647)  # INT_MIN is reserved for non-candidates
            key = tl.where(kept, 2147483647, key)
            key = tl.where(cand, key, -2147483647 - 1)
            tl.store(key_row + offs_w, key, mask=offs_w < W)
    if DO_SELECT:
        if DO_SCORE:
            # other threads of this program wrote the row: order their stores before our
            # loads (and read through L2 with .cg below, never a stale L1 line)
            tl.debug_barrier()
        k_eff = tl.maximum(tl.minimum(k_top, n - 1), 0)
        offs_t = tl.arange(0, TILE)
        if ONE_TILE:
            keys = tl.load(key_row + offs_t, mask=offs_t < W, other=-2147483647 - 1,
                           cache_modifier=".cg")
        # binary search on [lo, hi): count(>= lo) >= k_eff > count(>= hi); int64 bounds
        lo = tl.full([], -2147483647, tl.int64)
        hi = tl.full([], 2147483648, tl.int64)
        n_gt = tl.full([], 0, tl.int32)  # count(>= hi), i.e. count(> T) at the end
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            mid32 = mid.to(tl.int32)
            if ONE_TILE:
                cnt = tl.sum((keys >= mid32).to(tl.int32), axis=0)
            else:
                cnt = tl.full([], 0, tl.int32)
                for t0 in range(0, W, TILE):
                    kt = tl.load(key_row + t0 + offs_t, mask=t0 + offs_t < W,
                                 other=-2147483647 - 1, cache_modifier=".cg")
                    cnt += tl.sum((kt >= mid32).to(tl.int32), axis=0)
            ok = cnt >= k_eff
            lo = tl.where(ok, mid, lo)
            n_gt = tl.where(ok, n_gt, cnt)
            hi = tl.where(ok, hi, mid)
        thr = lo.to(tl.int32)
        n_eq_take = k_eff - n_gt  # ties at T taken, lowest block index first
        out_p = pages_ptr + b64 * stride_pb + h * stride_ph
        out_b = blocks_ptr + b64 * stride_bb + h * stride_bh
        base_gt = tl.full([], 0, tl.int32)
        base_eq = tl.full([], 0, tl.int32)
        for t0 in range(0, W, TILE):
            offs = t0 + offs_t
            if ONE_TILE:
                kt = keys
            else:
                kt = tl.load(key_row + offs, mask=offs < W, other=-2147483647 - 1,
                             cache_modifier=".cg")
            gt = (kt > thr).to(tl.int32)
            eq = (kt == thr).to(tl.int32)
            cs = tl.cumsum(gt + (eq << 16), axis=0)  # both counts in one scan (TILE < 2^16)
            c_gt = (cs & 0xFFFF) - gt + base_gt     # exclusive counts before each entry
            c_eq = (cs >> 16) - eq + base_eq
            sel = (gt > 0) | ((eq > 0) & (c_eq < n_eq_take))
            pos = c_gt + tl.minimum(c_eq, n_eq_take)
            page = tl.load(pt_row + offs, mask=sel, other=0)
            tl.store(out_p + pos, page, mask=sel)
            tl.store(out_b + pos, offs.to(tl.int64), mask=sel)
            base_gt += tl.sum(gt, axis=0)
            base_eq += tl.sum(eq, axis=0)
        # the last page at num_sel - 1; the unused tail repeats it, so every entry is a valid id
        last = tl.maximum(n - 1, 0)
        last_page = tl.load(pt_row + last)
        offs_k = tl.arange(0, BLOCK_K)
        tail = (offs_k >= k_eff) & (offs_k < k_out)
        tl.store(out_p + offs_k, tl.zeros([BLOCK_K], tl.int32) + last_page, mask=tail)
        tl.store(out_b + offs_k, tl.zeros([BLOCK_K], tl.int64) + last.to(tl.int64), mask=tail)
        tl.store(nsel_ptr + b * stride_nb + h, k_eff + (n > 0).to(tl.int32))


@functools.lru_cache(maxsize=None)
def _num_sms(index) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _default_splits(q, rows: int, chunks: int) -> int:
    """Programs per row for the score phase: 1 (fused) once rows alone fill the GPU."""
    sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
        if q.is_cuda else 8
    return max(1, min(chunks, triton.cdiv(SPLIT_PROGRAMS_PER_SM * sms, rows)))


def select_pages(q, kmin, kmax, page_table, num_pages, last_page_len, budget_pages, sink_pages,
                 local_pages, out_pages=None, out_num=None, out_blocks=None, *, num_splits=None,
                 block_w=None, num_warps=None):
    """Fused Quest/ArkVale page selection (``SparseAlgorithm.select``'s contract).

    Args:
        q:             [B, Hq, D]          decode queries, Hq = Hkv * G (last dim contiguous)
        kmin, kmax:    [S, D]              summary box rows (kmin <= kmax elementwise)
        page_table:    [B, Hkv, W] int32   all of each request's pages in order
        num_pages:     [B, Hkv] int32      valid entries of page_table (1..W)
        last_page_len: [B] int32           unused here (the caller's Selection carries it)
        budget_pages, sink_pages, local_pages: ints
        out_pages / out_num / out_blocks:  optional outputs, written in place
        num_splits:    score programs per row (1 = one fused launch; default: by SM count)
        block_w, num_warps: tuning overrides (pages per score step; warps of each launch)
    Returns:
        pages [B, Hkv, K] int32 physical ids, num_sel [B, Hkv] int32, blocks [B, Hkv, K] int64
        logical indices, K = max(1, min(budget - 1, W)) + 1 (= budget when W >= budget - 1).
        Entries < num_sel: the kept pages (first ``sink``, last ``local`` incl. the last page)
        and the highest-scoring others (ties: lower block first), in block order, then the last
        page at num_sel - 1 (num_sel = min(K, num_pages)); entries past it repeat the last page.
    """
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    assert Hq % Hkv == 0 and W >= 1
    assert q.stride(2) == 1 and kmin.stride(1) == 1 and kmax.stride(1) == 1
    page_table = page_table.to(torch.int32)  # no-ops for the engine's int32 tables
    num_pages = num_pages.to(torch.int32)
    if page_table.stride(2) != 1:
        page_table = page_table.contiguous()
    if num_pages.stride(1) != 1:
        num_pages = num_pages.contiguous()
    k_top = max(1, min(budget_pages - 1, W))
    k_out = k_top + 1
    dev = q.device
    if out_pages is None:
        out_pages = torch.empty(B, Hkv, k_out, dtype=torch.int32, device=dev)
    if out_num is None:
        out_num = torch.empty(B, Hkv, dtype=torch.int32, device=dev)
    if out_blocks is None:
        out_blocks = torch.empty(B, Hkv, k_out, dtype=torch.int64, device=dev)
    assert out_pages.shape == (B, Hkv, k_out) and out_pages.dtype == torch.int32
    assert out_blocks.shape == (B, Hkv, k_out) and out_blocks.dtype == torch.int64
    assert out_num.shape == (B, Hkv) and out_num.dtype == torch.int32
    assert out_pages.stride(2) == 1 and out_blocks.stride(2) == 1 and out_num.stride(1) == 1
    if B == 0:
        return out_pages, out_num, out_blocks
    keys = torch.empty(B, Hkv, W, dtype=torch.int32, device=dev)  # scratch: one key per page
    num_splits, block_w, num_warps = (num_splits or NUM_SPLITS, block_w or BLOCK_W,
                                      num_warps or NUM_WARPS)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    block_w = block_w or max(16, min(64, 8192 // BLOCK_D))
    TILE = max(16, min(MAX_TILE, triton.next_power_of_2(W)))
    chunks = triton.cdiv(W, block_w)
    splits = num_splits or _default_splits(q, B * Hkv, chunks)
    splits = max(1, min(splits, chunks))
    cps = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, cps)
    sel_warps = num_warps or (4 if TILE <= 1024 else 8 if TILE <= 4096 else 16)
    args = (q, kmin, kmax, page_table, num_pages, keys, out_pages, out_blocks, out_num,
            q.stride(0), q.stride(1), kmin.stride(0), kmax.stride(0), page_table.stride(0),
            page_table.stride(1), num_pages.stride(0), keys.stride(0), keys.stride(1),
            out_pages.stride(0), out_pages.stride(1), out_blocks.stride(0), out_blocks.stride(1),
            out_num.stride(0), W, k_top, k_out, sink_pages, local_pages, cps)
    meta = dict(G=Hq // Hkv, D=D, BLOCK_W=block_w, BLOCK_D=BLOCK_D, TILE=TILE, ONE_TILE=TILE >= W,
                BLOCK_K=triton.next_power_of_2(k_out))
    if splits == 1:
        _page_select_kernel[(B, Hkv, 1)](*args, **meta, DO_SCORE=True, DO_SELECT=True,
                                         num_warps=sel_warps)
    else:
        _page_select_kernel[(B, Hkv, splits)](*args, **meta, DO_SCORE=True, DO_SELECT=False,
                                              num_warps=num_warps or 4)
        _page_select_kernel[(B, Hkv, 1)](*args, **meta, DO_SCORE=False, DO_SELECT=True,
                                         num_warps=sel_warps)
    return out_pages, out_num, out_blocks
