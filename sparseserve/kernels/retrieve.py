"""Fused `retrieve` of the two-tier cache for one layer (GPU path of TwoTierCache.retrieve).

The torch version of retrieve is ~60 small kernels per layer (masks, index_put, fills over
the slot arrays); profiled, they were the largest part of the offloaded decode step's
overhead. Here it is five launches plus two tiny scans, with the same contract:

1. ``probe``: every selected entry (b, h, k < num_sel[b, h]) looks its host page up in the
   residency index (kernels/residency_hash.py); hits are touched (last_access = step) so they
   cannot become victims; misses are flagged; hit/miss counters are bumped on the device.
2. victim order: category LRU by a counting sort (``resident_counts`` + ``victim_keys`` here,
   then ``bucket_order``'s place pass) — the key of kvcache/eviction.py computed in one pass
   instead of ~15 element-wise ops. Plain LRU keeps its torch sort (the baseline).
3. ``assign``: the i-th miss (rank from a cumulative sum) takes the i-th victim: page_of,
   last_access and owner of that slot are rewritten (what it held is unmapped with it: the
   residency index is rebuilt from page_of afterwards).

Fixed shapes, no host synchronisation (CUDA-graph capturable). Ids are not range-checked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter
from .bucket_order import place_by_key
from .residency_hash import probe_slots

patch_triton_interpreter()

BLOCK = 256


@triton.jit
def _probe_kernel(pages_ptr, nsel_ptr, table_ptr, page_of_ptr, last_ptr, step_ptr,
                  slots_ptr, miss_ptr, cnt_ptr, N, K, mask, scratch_page, scratch_slot,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    n = tl.load(nsel_ptr + i // K, mask=m, other=0)
    valid = m & ((i % K) < n)
    p = tl.load(pages_ptr + i, mask=valid, other=-1).to(tl.int64)
    is_scratch = valid & (p == scratch_page)
    look = valid & ~is_scratch
    slot = probe_slots(table_ptr, page_of_ptr, p, look, mask, BLOCK)
    hit = look & (slot >= 0)
    miss = look & (slot < 0)
    step = tl.load(step_ptr)
    tl.store(last_ptr + tl.maximum(slot, 0), tl.zeros((BLOCK,), tl.int64) + step, mask=hit)
    tl.store(slots_ptr + i, tl.where(hit, slot, scratch_slot), mask=m)
    tl.store(miss_ptr + i, miss.to(tl.int32), mask=m)
    tl.atomic_add(cnt_ptr, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 1, tl.sum(miss.to(tl.int64), axis=0))


@triton.jit
def _resident_kernel(last_ptr, owner_ptr, resident_ptr, S, R, R_PAD: tl.constexpr,
                     BLOCK: tl.constexpr):
    """resident[r] += slots of this block owned by row r (a block histogram, then one atomic
    per row: a few rows own most slots, so per-slot atomics would serialise)."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = s < S
    used = ok & (tl.load(last_ptr + s, mask=ok, other=-1) >= 0)
    own = tl.load(owner_ptr + s, mask=ok, other=0).to(tl.int32)
    h = tl.histogram(own, R_PAD, mask=used)
    r = tl.arange(0, R_PAD)
    tl.atomic_add(resident_ptr + r, h, mask=(r < R) & (h > 0))


@triton.jit
def _victim_key_kernel(last_ptr, owner_ptr, quota_ptr, resident_ptr, step_ptr, key_ptr,
                       counts_ptr, S, NUM_BUCKETS: tl.constexpr, KEYS_PAD: tl.constexpr,
                       BLOCK: tl.constexpr):
    """key (higher = evicted earlier): 0 used this step | 1..B in quota | B+1..2B over
    quota | 2B+1 free (kvcache/eviction.py's layout), and its count."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = s < S
    last = tl.load(last_ptr + s, mask=ok, other=-1)
    own = tl.load(owner_ptr + s, mask=ok, other=0)
    step = tl.load(step_ptr)
    free = last < 0
    age = tl.maximum(step - last, 0)
    over = (tl.load(resident_ptr + own, mask=ok, other=0).to(tl.int64)
            > tl.load(quota_ptr + own, mask=ok, other=0)) & ~free
    key = 1 + tl.minimum(age, NUM_BUCKETS - 1) + over.to(tl.int64) * NUM_BUCKETS
    key = tl.where(free, 2 * NUM_BUCKETS + 1, key)
    key = tl.where((age == 0) & ~free, 0, key).to(tl.int32)
    tl.store(key_ptr + s, key, mask=ok)
    h = tl.histogram(key, KEYS_PAD, mask=ok)
    k = tl.arange(0, KEYS_PAD)
    tl.atomic_add(counts_ptr + k, h, mask=(k < 2 * NUM_BUCKETS + 2) & (h > 0))


@triton.jit
def _assign_kernel(pages_ptr, miss_ptr, rank_ptr, order_ptr, rows_ptr, page_of_ptr, last_ptr,
                   owner_ptr, step_ptr, slots_ptr, load_src_ptr, N, HK, S,
                   BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    miss = m & (tl.load(miss_ptr + i, mask=m, other=0) != 0)
    rank = tl.minimum(tl.load(rank_ptr + i, mask=miss, other=1) - 1, S - 1)
    victim = tl.load(order_ptr + rank, mask=miss, other=0)
    p = tl.load(pages_ptr + i, mask=miss, other=-1).to(tl.int64)
    row = tl.load(rows_ptr + i // HK, mask=miss, other=0).to(tl.int64)
    step = tl.load(step_ptr)
    tl.store(page_of_ptr + victim, p, mask=miss)
    tl.store(last_ptr + victim, tl.zeros((BLOCK,), tl.int64) + step, mask=miss)
    tl.store(owner_ptr + victim, row, mask=miss)
    tl.store(slots_ptr + i, victim, mask=miss)
    tl.store(load_src_ptr + i, tl.where(miss, p, -1), mask=m)


def category_lru_order(last_access, owner_row, row_quota, step, num_buckets: int):
    """kvcache.eviction.victim_order(..., "category-lru") in two passes + a place pass.
    last_access/owner_row [S] int64, row_quota [R] int64, step [] int64 -> [S] int64."""
    S = last_access.shape[0]
    dev = last_access.device
    grid = (triton.cdiv(S, BLOCK),)
    R = row_quota.shape[0]
    resident = torch.zeros(R, dtype=torch.int32, device=dev)
    _resident_kernel[grid](last_access, owner_row, resident, S, R,
                           R_PAD=triton.next_power_of_2(R), BLOCK=BLOCK)
    key = torch.empty(S, dtype=torch.int32, device=dev)
    counts = torch.zeros(2 * num_buckets + 2, dtype=torch.int32, device=dev)
    _victim_key_kernel[grid](last_access, owner_row, row_quota, resident, step, key, counts, S,
                             NUM_BUCKETS=num_buckets,
                             KEYS_PAD=triton.next_power_of_2(2 * num_buckets + 2), BLOCK=BLOCK)
    return place_by_key(key, counts)


def fused_retrieve(pages, num_sel, rows, table, page_of, last, owner, row_quota, step,
                   counters, scratch_page: int, scratch_slot: int, policy: str,
                   num_buckets: int):
    """One layer's retrieve on the GPU (see module doc).

    pages [B, Hkv, K] int32/int64 selected host pages; num_sel [B, Hkv] int32 valid entries;
    rows [B] batch rows; table [H] int32 residency index; page_of/last/owner [S + 1] int64
    (the last entry is the scratch slot); row_quota [R] int64; step [] int64; counters [2]
    int64 (+= hits, misses). -> (slots [B, Hkv, K] int64: the slot of every valid entry,
    the scratch slot elsewhere; load_src [N] int64: host page to load into slots[i], -1 = none).
    """
    from sparseserve.kvcache.eviction import victim_order

    B, Hkv, K = pages.shape
    N = B * Hkv * K
    S = page_of.shape[0] - 1
    dev = pages.device
    pages = pages.contiguous()
    num_sel = num_sel.contiguous()
    slots = torch.empty(N, dtype=torch.int64, device=dev)
    miss = torch.empty(N, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(N, BLOCK),)
    _probe_kernel[grid](pages, num_sel, table, page_of, last, step, slots, miss, counters, N, K,
                        table.shape[0] - 1, scratch_page, scratch_slot, BLOCK=BLOCK)
    if policy == "category-lru":
        order = category_lru_order(last[:S], owner[:S], row_quota, step, num_buckets)
    else:
        order = victim_order(last[:S], owner[:S], row_quota, step, policy)
    rank = torch.cumsum(miss, 0, dtype=torch.int32)
    load_src = torch.empty(N, dtype=torch.int64, device=dev)
    _assign_kernel[grid](pages, miss, rank, order, rows.contiguous(), page_of, last, owner,
                         step, slots, load_src, N, Hkv * K, S, BLOCK=BLOCK)
    return slots.view(B, Hkv, K), load_src
