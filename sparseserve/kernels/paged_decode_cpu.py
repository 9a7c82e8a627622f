"""Paged decode attention for CPU tensors: the CPU engine's decode step (no Triton).

Same contract as ``ref.paged_decode_attention`` (softmax(scale * q K^T) V over the pages of
``page_table``, one query token per request), fewer bytes moved. Measured on the 2-core CPU
machine (batch 16, 3 KV heads x 3 query heads, 640 tokens per row, fp32, one thread): the
reference takes ~8.6 ms per layer, this ~3.8 ms. Why:

* The reference gathers K and V into dense tensors (``index_select``: each read and written
  once more) and zeroes the V of dropped tokens with a full ``masked_fill_`` pass (so that
  garbage in a page's unwritten tail never reaches the output as 0 * NaN).
* Here V is never gathered: ``F.embedding_bag`` with ``per_sample_weights`` sums the softmax
  weights times V rows straight from the cache, one bag per (request, query head), and the
  bags hold only the attended tokens -- dropped tokens are not in them, so no mask pass and
  no garbage. K is still gathered (a dot product per token has no fused gather op in torch)
  and dropped scores are masked to -inf, as in the reference.

The layer-independent part (which token rows each bag reads) is ``plan_decode``, computed
once per step by the engine (``ForwardContext``) and reused by every layer; sparse decode,
whose page tables differ per layer, plans per call.

Caches other than fp32 fall back to the reference: ``embedding_bag`` needs its weights in the
cache's dtype, and the softmax weights must stay fp32 (the reference's precision).

When the fused C++ kernel builds (``paged_decode_cpu_fused``: K and V read once in place, no
gather, no plan; 0.41-0.56x this torch path's time per layer at batch 16 x 513-640 tokens),
``plan_decode`` returns a plan that only carries the page table and ``decode_planned`` calls
the kernel; the torch path above is the fallback (no compiler, ``SPARSESERVE_CPU_DECODE=torch``,
or ``plan_decode(..., fused=False)``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import paged_decode_cpu_fused as fused_kernel
from . import ref


class DecodePlan(NamedTuple):
    """Which cache rows a decode step attends (``plan_decode``); B requests, Hkv KV heads,
    W page-table entries, ps tokens per page, G query heads per KV head. A plan for the fused
    kernel carries only the last three fields (the torch ones are None)."""
    page_ids: torch.Tensor | None     # [B * Hkv * W] int64 K pages to gather (0 past num_pages)
    drop_s: torch.Tensor | None       # [B, Hkv, 1, W * ps] bool: scores of tokens not attended
    bag_rows: torch.Tensor | None     # [sum_b,h G * n_bh] int64 V rows (page * ps + t), by bag
    bag_offsets: torch.Tensor | None  # [B * Hkv * G] int64 start of each (b, h, g) bag
    weight_pos: torch.Tensor | None   # [len(bag_rows)] int64 flat index of each row's weight in p
    ref_plan: tuple | None            # ``ref.paged_decode_plan`` (the fallback for other dtypes)
    groups: int                       # G
    page_table: torch.Tensor | None = None     # [B, Hkv, W] int32 (fused plans)
    num_pages: torch.Tensor | None = None      # [B, Hkv] int32
    last_page_len: torch.Tensor | None = None  # [B] int32


def plan_decode(page_table: torch.Tensor, num_pages: torch.Tensor, last_page_len: torch.Tensor,
                page_size: int, groups: int, fused: bool | None = None) -> DecodePlan:
    """The plan of ``decode_planned``: page_table [B, Hkv, W] int32, num_pages [B, Hkv] int32
    (>= 1), last_page_len [B] int32 (1..page_size), ``groups`` = Hq // Hkv. ``fused`` None:
    the fused kernel's plan when it is built (no ops), else (False) the torch path's plan: a
    few dozen ops and one host sync (the number of attended rows); once per step."""
    if fused is None:
        fused = not page_table.is_cuda and fused_kernel.available()
    if fused:
        return DecodePlan(None, None, None, None, None, None, groups,
                          page_table.to(torch.int32), num_pages.to(torch.int32),
                          last_page_len.to(torch.int32))
    B, Hkv, W = page_table.shape
    ref_plan = ref.paged_decode_plan(page_table, num_pages, last_page_len, page_size)
    page_ids, drop_s = ref_plan[0], ref_plan[1]
    valid = ~drop_s                                                      # [B, Hkv, 1, N]
    N = W * page_size
    t = torch.arange(page_size, device=page_table.device)
    rows = (page_ids.view(B, Hkv, W, 1) * page_size + t).view(B, Hkv, 1, N)
    valid_g = valid.expand(B, Hkv, groups, N)
    # boolean selection keeps row-major order: bag (b, h, g) is contiguous, tokens in order
    weight_pos = valid_g.reshape(-1).nonzero().squeeze(1)                # [R]
    bag_rows = rows.expand(B, Hkv, groups, N).reshape(-1).index_select(0, weight_pos)
    counts = valid_g.sum(-1).reshape(-1)                                 # [B * Hkv * G]
    bag_offsets = torch.cumsum(counts, 0) - counts
    return DecodePlan(page_ids, drop_s, bag_rows, bag_offsets, weight_pos, ref_plan, groups)


def decode_planned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: DecodePlan, scale: float) -> torch.Tensor:
    """q [B, Hq, D], k_cache / v_cache [P, page_size, D] -> [B, Hq, D] in q's dtype."""
    if plan.page_ids is None:  # a fused plan: the kernel, or the reference for what it can't take
        if fused_kernel.usable(q, k_cache, v_cache):
            return fused_kernel.paged_decode_fused(q, k_cache, v_cache, plan.page_table,
                                                   plan.num_pages, plan.last_page_len, scale)
        return ref.paged_decode_attention(q, k_cache, v_cache, plan.page_table, plan.num_pages,
                                          plan.last_page_len, scale)
    if k_cache.dtype != torch.float32 or q.dtype != torch.float32:
        return ref.paged_decode_planned(q, k_cache, v_cache, plan.ref_plan, scale)
    B, Hq, D = q.shape
    G = plan.groups
    Hkv = Hq // G
    N = plan.drop_s.shape[-1]
    k = k_cache.index_select(0, plan.page_ids).view(B, Hkv, N, D)
    s = torch.matmul(q.reshape(B, Hkv, G, D), k.transpose(-1, -2))      # [B, Hkv, G, N]
    s.mul_(scale).masked_fill_(plan.drop_s, float("-inf"))
    p = torch.softmax(s, dim=-1).reshape(-1).index_select(0, plan.weight_pos)
    out = F.embedding_bag(plan.bag_rows, v_cache.view(-1, D), plan.bag_offsets, mode="sum",
                          per_sample_weights=p)                          # [B * Hkv * G, D]
    return out.view(B, Hq, D)


def paged_decode_attention(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale,
                           out=None, fused: bool | None = None):
    """``ref.paged_decode_attention``'s contract, planned and run in one call (the fused kernel
    when it is built and takes these tensors)."""
    plan = plan_decode(page_table, num_pages, last_page_len, k_cache.shape[1],
                       q.shape[1] // page_table.shape[1], fused=fused)
    o = decode_planned(q, k_cache, v_cache, plan, scale)
    if out is None:
        return o
    out.copy_(o)
    return out
