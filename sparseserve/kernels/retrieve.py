"""Fused `retrieve` of the two-tier cache for one layer (GPU path of TwoTierCache.retrieve).

The torch version of retrieve is ~60 small kernels per layer (masks, index_put, fills over
the slot arrays); profiled, they were the largest part of the offloaded decode step's
overhead. Here it is six launches plus the residency index's rebuild check, with the same
contract (in a CUDA graph each tiny launch costs ~2-4 us plus a gap, so scans, fills and
masks that could ride along in a kernel are folded in: benchmarks/decode_launches.py counts):

1. ``probe``: every selected entry (b, h, k < num_sel[b, h]) looks its host page up in the
   residency index (kernels/residency_hash.py); hits are touched (last_access = step) so they
   cannot become victims; misses are flagged and counted per program (a page with no data yet
   — k >= fresh_from[b, h], or the last valid entry of a row whose token starts a page — needs
   a slot, but is no miss and loads nothing); hit/miss counters are bumped on the device; a
   decode selection stamps its pages' working-set step (worker/selection_stamps.py).
2. victim order: category LRU by a counting sort over the keys of kvcache/eviction.py
   (kernels/category_lru.py: ``resident``, ``victim_key``, then ``place``, which lays out only
   the keys whose slots this call's misses can reach). Plain LRU keeps its torch sort (the
   baseline).
3. ``assign``: the i-th miss (its rank: the misses of earlier probe programs plus a running
   count in its block) takes the i-th victim: page_of, last_access and owner of that slot are
   rewritten, the new mapping is inserted into the residency index (the old one goes stale;
   the index rebuilds itself when full), and the pages to load are written compacted (entry
   i - 1 for rank i), so FlashH2D loops over the misses only. It also zeroes the victim
   order's histograms for the next call (the caller's scratch: no fill launch).

Fixed shapes, no host synchronisation (CUDA-graph capturable). Ids are not range-checked,
except in debug builds (TRITON_DEBUG=1: device asserts on every page, slot and position).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter
from .category_lru import _sum_first, category_lru_order
from .residency_hash import insert_slots, probe_slots, rebuild_if_full

patch_triton_interpreter()

# per-entry kernels (probe, assign): 128 entries = one per thread of 4 warps (smaller blocks
# replicate elements across threads, and assign's atomic_cas insert must run once per entry)
ENTRY_BLOCK = 128


@triton.jit
def _fresh_from(fresh_ptr, i, m, n, K, HK, FRESH: tl.constexpr):
    """First entry of entry i's selection row that holds no data yet. FRESH 1: fresh_ptr
    [B * Hkv] gives it; 2: fresh_ptr [B] flags a row whose token starts a page: its last
    valid entry (n - 1, n = num_sel of the row) is that page, else none (K)."""
    if FRESH == 1:
        f = tl.load(fresh_ptr + i // K, mask=m, other=0)
    else:
        f = tl.where(tl.load(fresh_ptr + i // HK, mask=m, other=0) != 0, n - 1, K)
    return f


# sizes that change from step to step are not specialised on (== 1, % 16), nor is the
# alignment of the per-step inputs (slices of packed or double-buffered tensors: a page list's
# offset, the pending-mark touch `marks[step % 2]`): a new class would compile a variant
# mid-serving, which the start-up warm-up cannot foresee (the H200's HTTP TTFT stall:
# serving.md, twentieth session). Their loads are per-entry gathers: alignment buys nothing.
@triton.jit(do_not_specialize=["N", "K", "HK", "layer_out"],
            do_not_specialize_on_alignment=["pages_ptr", "nsel_ptr", "fresh_ptr", "step_ptr",
                                            "stamps_ptr", "sstep_ptr"])
def _probe_kernel(pages_ptr, nsel_ptr, fresh_ptr, table_ptr, page_of_ptr, last_ptr, step_ptr,
                  slots_ptr, miss_ptr, mcount_ptr, cnt_ptr, stamps_ptr, sstep_ptr, N, K, HK,
                  mask, scratch_page, scratch_slot, layer_table, layer_slots, layer_out,
                  FRESH: tl.constexpr, HAS_STAMPS: tl.constexpr, BLOCK: tl.constexpr):
    # axis 1: the layer (one per call, or every layer of a prefill's mapping: the same pages)
    lyr = tl.program_id(1).to(tl.int64)
    table_ptr += lyr * layer_table
    page_of_ptr += lyr * layer_slots
    last_ptr += lyr * layer_slots
    slots_ptr += lyr * layer_out
    miss_ptr += lyr * N
    mcount_ptr += lyr * tl.num_programs(0)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    n = tl.load(nsel_ptr + i // K, mask=m, other=0)
    valid = m & ((i % K) < n)
    p = tl.load(pages_ptr + i, mask=valid, other=-1).to(tl.int64)
    # debug builds (TRITON_DEBUG=1) check the ids the step's loads and stores will follow
    tl.device_assert(~valid | ((p >= 0) & (p <= scratch_page)), "probe: page id out of range")
    is_scratch = valid & (p == scratch_page)
    look = valid & ~is_scratch
    if HAS_STAMPS:  # SelectionStamps.stamp: the scratch page is never stamped
        sstep = tl.load(sstep_ptr)
        tl.store(stamps_ptr + tl.maximum(p, 0), tl.zeros((BLOCK,), tl.int32) + sstep,
                 mask=look)
    slot = probe_slots(table_ptr, page_of_ptr, p, look, mask, BLOCK)
    tl.device_assert(slot < scratch_slot, "probe: slot out of range")
    hit = look & (slot >= 0)
    miss = look & (slot < 0)
    counted = miss
    if FRESH != 0:
        counted = miss & ((i % K) < _fresh_from(fresh_ptr, i, m, n, K, HK, FRESH))
    step = tl.load(step_ptr)
    tl.store(last_ptr + tl.maximum(slot, 0), tl.zeros((BLOCK,), tl.int64) + step, mask=hit)
    tl.store(slots_ptr + i, tl.where(hit, slot, scratch_slot).to(tl.int32), mask=m)
    tl.store(miss_ptr + i, miss.to(tl.int32), mask=m)
    # this program's misses: assign ranks them after its predecessors' (no scan launch)
    tl.store(mcount_ptr + tl.program_id(0), tl.sum(miss.to(tl.int32), axis=0))
    tl.atomic_add(cnt_ptr, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 1, tl.sum(counted.to(tl.int64), axis=0))


# as _probe_kernel: neither step-varying sizes nor per-step inputs' alignment specialised
@triton.jit(do_not_specialize=["N", "K", "HK", "NUM_ZERO", "layer_out"],
            do_not_specialize_on_alignment=["pages_ptr", "nsel_ptr", "rows_ptr", "fresh_ptr",
                                            "step_ptr", "zero_ptr"])
def _assign_kernel(pages_ptr, nsel_ptr, miss_ptr, mcount_ptr, order_ptr, rows_ptr, fresh_ptr,
                   page_of_ptr, last_ptr, owner_ptr, step_ptr, slots_ptr, load_src_ptr,
                   load_dst_ptr, nloads_ptr, table_ptr, fill_ptr, zero_ptr, N, K, HK, S, mask,
                   NUM_ZERO, layer_table, layer_slots, layer_fill, layer_zero, layer_out,
                   FRESH: tl.constexpr, BLOCK: tl.constexpr):
    # axis 1: the layer (slots and load lists [L, layer_out], misses [L, N], order [L, S],
    # load counts [L, 4]; state by its strides)
    lyr = tl.program_id(1).to(tl.int64)
    miss_ptr += lyr * N
    mcount_ptr += lyr * tl.num_programs(0)
    order_ptr += lyr * S
    page_of_ptr += lyr * layer_slots
    last_ptr += lyr * layer_slots
    owner_ptr += lyr * layer_slots
    slots_ptr += lyr * layer_out
    load_src_ptr += lyr * layer_out
    load_dst_ptr += lyr * layer_out
    nloads_ptr += lyr * 4
    table_ptr += lyr * layer_table
    fill_ptr += lyr * layer_fill
    zero_ptr += lyr * layer_zero
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    missi = tl.load(miss_ptr + i, mask=m, other=0)
    miss = m & (missi != 0)
    # the miss's rank (0-based) over all entries: misses of earlier programs (probe's
    # per-program counts), then this block's running count
    rank = _sum_first(mcount_ptr, pid, 1024) + tl.cumsum(missi, axis=0) - 1
    victim = tl.load(order_ptr + tl.minimum(tl.maximum(rank, 0), S - 1), mask=miss, other=0)
    tl.device_assert(~miss | ((victim >= 0) & (victim < S) & (rank >= 0)),
                     "assign: victim out of range")
    p = tl.load(pages_ptr + i, mask=miss, other=-1).to(tl.int64)
    row = tl.load(rows_ptr + i // HK, mask=miss, other=0).to(tl.int64)
    step = tl.load(step_ptr)
    load = miss
    if FRESH != 0:  # a page with no data yet gets its slot, nothing is loaded into it
        n = tl.load(nsel_ptr + i // K, mask=m, other=0)
        load = miss & ((i % K) < _fresh_from(fresh_ptr, i, m, n, K, HK, FRESH))
    tl.store(page_of_ptr + victim, p, mask=miss)
    tl.store(last_ptr + victim, tl.zeros((BLOCK,), tl.int64) + step, mask=miss)
    tl.store(owner_ptr + victim, row, mask=miss)
    tl.store(slots_ptr + i, victim.to(tl.int32), mask=miss)
    tl.store(load_src_ptr + rank, tl.where(load, p, -1), mask=miss)
    tl.store(load_dst_ptr + rank, victim, mask=miss)
    tl.atomic_add(fill_ptr, tl.sum(miss.to(tl.int64), axis=0))
    insert_slots(table_ptr, p, victim.to(tl.int32), miss, mask)
    if pid == 0:
        # the loader's count, and the victim order's scratch (histograms: place has read
        # them) zeroed for the next call — instead of a fill launch per layer
        tl.store(nloads_ptr, _sum_first(mcount_ptr, tl.num_programs(0), 1024))
        for c in range(0, NUM_ZERO, BLOCK):
            j = c + tl.arange(0, BLOCK)
            tl.store(zero_ptr + j, tl.zeros((BLOCK,), tl.int32), mask=j < NUM_ZERO)


def fused_retrieve(pages, num_sel, rows, table, page_of, last, owner, row_quota, step,
                   counters, table_fill, scratch_page: int, scratch_slot: int,
                   num_buckets: int, fresh_from=None, victim_order=None, *, fresh_last=None,
                   stamps=None, lru_scratch=None, rebuild: bool = True, touch=None):
    """One layer's retrieve on the GPU (see module doc).

    pages [B, Hkv, K] int32/int64 selected host pages; num_sel [B, Hkv] int32 valid entries;
    rows [B] batch rows; table [H] int32 residency index, table_fill [2] int64 its entry
    count; page_of/last/owner [S + 1] int64 (the last entry is the scratch slot); row_quota
    [R] int64; step [] int64; counters [2] int64 (+= hits, misses); fresh_from [B, Hkv] int32
    or None: entries k >= fresh_from[b, h] hold no data yet (no load, not counted as misses);
    fresh_last [B] int32/bool or None (instead of fresh_from): where set, the last valid
    entry of each of row b's selections (k = num_sel[b, h] - 1) holds no data yet.
    stamps: None, or (last_selected [>= scratch_page + 1] int32, stamp step [] int32): every
    valid entry's page (the scratch page aside) is stamped with the step (SelectionStamps).
    lru_scratch: None or [lru_scratch_size(R, num_buckets)] int32, zeroed, left zeroed
    (category LRU's histograms without a fill launch per call).
    -> (slots [B, Hkv, K] int32: the slot of every valid entry, the scratch slot elsewhere;
    load_src, load_dst [N] int64 compacted: host page (-1: nothing to load) and its slot,
    valid below num_loads[0]; num_loads [1] int32 on the device).
    victim_order: None for category LRU with `num_buckets` age buckets (fused here), or the
    policy's own order f(last [S], owner [S], row_quota, step) -> [S] slots, first evicted
    first (the caller's policy module; it sees the hits already touched).
    touch: None, or [] int64 on the device: what the mapped slots' last_access is set to
    instead of `step` (hits and misses alike; e.g. a prefill's pending-save mark, so no mark
    launch follows). The victim order is the same: a value >= step is age 0 either way.
    rebuild: False leaves the residency index's rebuild-if-full to the caller (the decode
    step does every layer's at once after its layers; safe because one call inserts at most
    S entries into a table of >= 4 S kept at most half full between rebuilds).

    Several layers at once (the same selection mapped in each: a prefill's pages): table
    [L, H], page_of / last / owner [L, S + 1], table_fill [L, 2], lru_scratch [L, size] (rows
    of the cache's per-layer state, contiguous within a row) -> slots [L, B, Hkv, K],
    load_src / load_dst [L, N], num_loads [L, 1]: each layer's mapping on its own, as L calls
    would make them, in one set of launches. Category LRU only, no stamps.
    """
    B, Hkv, K = pages.shape
    N = B * Hkv * K
    one = page_of.dim() == 1
    if one:
        table, page_of, last, owner = (t.unsqueeze(0) for t in (table, page_of, last, owner))
        table_fill = table_fill.unsqueeze(0)
        lru_scratch = None if lru_scratch is None else lru_scratch.unsqueeze(0)
    else:
        assert victim_order is None and stamps is None, "several layers: category LRU only"
    L, S = page_of.shape[0], page_of.shape[1] - 1
    assert last.stride() == page_of.stride() == owner.stride() and page_of.stride(1) == 1
    assert table.stride(1) == 1 and table_fill.stride(1) == 1
    dev = pages.device
    # no-ops on the decode path (its tensors are contiguous and int32 already)
    pages = pages.contiguous()
    num_sel = num_sel.contiguous()
    assert fresh_from is None or fresh_last is None
    mode, fresh = 0, num_sel
    if fresh_from is not None:
        mode, fresh = 1, fresh_from.to(torch.int32).contiguous()
    elif fresh_last is not None:
        mode, fresh = 2, fresh_last.contiguous()
    has_stamps = stamps is not None
    st, sstep = stamps if has_stamps else (num_sel, num_sel)
    grid = (triton.cdiv(N, ENTRY_BLOCK), L)
    # each layer's row of slots, load lists and load count starts 16-byte aligned, as one
    # layer's own allocation would: the kernels that read them (slot store, paged prefill,
    # FlashH2D) keep the specialisation the warm-up compiled
    slots = torch.empty((L, -(-N // 4) * 4), dtype=torch.int32, device=dev)
    miss = torch.empty((L, N), dtype=torch.int32, device=dev)
    mcount = torch.empty((L, grid[0]), dtype=torch.int32, device=dev)  # misses per program
    mask = table.shape[1] - 1
    touch = step if touch is None else touch  # written into last_access by probe and assign
    lt, ls = table.stride(0), page_of.stride(0)
    _probe_kernel[grid](pages, num_sel, fresh, table, page_of, last, touch, slots, miss,
                        mcount, counters, st, sstep, N, K, Hkv * K, mask, scratch_page,
                        scratch_slot, lt, ls, slots.stride(0), FRESH=mode,
                        HAS_STAMPS=has_stamps, BLOCK=ENTRY_BLOCK)
    zero = lru_scratch
    if victim_order is None:
        order = category_lru_order(last[:, :S], owner[:, :S], row_quota, step, num_buckets,
                                   need=mcount, scratch=lru_scratch)
    else:
        order = victim_order(last[0, :S], owner[0, :S], row_quota, step)[None]
        zero = None  # not used: stays zeroed
    load_src = torch.empty((L, slots.shape[1]), dtype=torch.int64, device=dev)
    load_dst = torch.empty((L, slots.shape[1]), dtype=torch.int64, device=dev)
    num_loads = torch.empty((L, 4), dtype=torch.int32, device=dev)
    _assign_kernel[grid](pages, num_sel, miss, mcount, order, rows.contiguous(), fresh,
                         page_of, last, owner, touch, slots, load_src, load_dst, num_loads,
                         table, table_fill, miss if zero is None else zero, N, K, Hkv * K, S,
                         mask, 0 if zero is None else zero.shape[1], lt, ls,
                         table_fill.stride(0), 0 if zero is None else zero.stride(0),
                         slots.stride(0), FRESH=mode, BLOCK=ENTRY_BLOCK)
    if rebuild:  # else the caller runs rebuild_if_full before the table can fill up
        rebuild_if_full(table, page_of, table_fill, backend="triton")  # also CPU tensors (tests)
    slots = slots[:, :N].unflatten(1, (B, Hkv, K))
    load_src, load_dst, num_loads = load_src[:, :N], load_dst[:, :N], num_loads[:, :1]
    if one:
        return slots[0], load_src[0], load_dst[0], num_loads[0]
    return slots, load_src, load_dst, num_loads
