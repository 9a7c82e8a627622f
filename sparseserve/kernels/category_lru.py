"""Category LRU's victim order on the device (kvcache/eviction.py's policy, fused retrieve's
step 2; kernels/retrieve.py): a counting sort over each slot's eviction key in three passes —
``resident`` (slots each row holds), ``victim_key`` (each slot's key and each program's key
histogram), ``place`` (the slots of the keys the call's misses reach, at positions from the
counts of earlier programs: no scan launch, no atomics, deterministic). One layer, or several
layers' orders in one set of launches (axis 1 of every grid is the layer)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

BLOCK = 256


@triton.jit
def _sum_first(ptr, n, CHUNK: tl.constexpr):
    """sum(ptr[0:n]) of an int32 array, n a run-time count (0: 0). Integer sums are exact in
    any order, so a program summing its predecessors' counts replaces a scan launch and
    stays deterministic."""
    acc = tl.zeros((CHUNK,), tl.int32)
    for c in range(0, n, CHUNK):
        j = c + tl.arange(0, CHUNK)
        acc += tl.load(ptr + j, mask=j < n, other=0)
    return tl.sum(acc, axis=0)




# resident and victim_key pass over every slot; with no miss this call (every selected page
# hit: most decode steps at light load) nobody reads their output — place lays out nothing,
# assign takes no victim — so each program returns after summing the probe's miss counts
# (`need`, ~N / 128 int32): the launches stay (fixed graph), the slot passes go


@triton.jit(do_not_specialize=["NEED_N"])
def _resident_kernel(last_ptr, owner_ptr, resident_ptr, need_ptr, S, R, NEED_N, layer_slots,
                     layer_scratch, R_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """resident[r] += slots of this block owned by row r (a block histogram, then one atomic
    per row: a few rows own most slots, so per-slot atomics would serialise); nothing when
    sum(need_ptr[0:NEED_N]) == 0. Axis 1: the layer (strides layer_slots, layer_scratch)."""
    lyr = tl.program_id(1).to(tl.int64)
    last_ptr += lyr * layer_slots
    owner_ptr += lyr * layer_slots
    resident_ptr += lyr * layer_scratch
    need_ptr += lyr * NEED_N
    if _sum_first(need_ptr, NEED_N, 1024) > 0:
        s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = s < S
        used = ok & (tl.load(last_ptr + s, mask=ok, other=-1) >= 0)
        own = tl.load(owner_ptr + s, mask=ok, other=0).to(tl.int32)
        h = tl.histogram(own, R_PAD, mask=used)
        r = tl.arange(0, R_PAD)
        tl.atomic_add(resident_ptr + r, h, mask=(r < R) & (h > 0))


@triton.jit(do_not_specialize=["NEED_N"])
def _victim_key_kernel(last_ptr, owner_ptr, quota_ptr, resident_ptr, step_ptr, key_ptr,
                       counts_ptr, hist_ptr, need_ptr, S, NEED_N, layer_slots, layer_scratch,
                       NUM_BUCKETS: tl.constexpr, KEYS_PAD: tl.constexpr,
                       BLOCK: tl.constexpr):
    """key (higher = evicted earlier): 0 used this step | 1..B in quota | B+1..2B over
    quota | 2B+1 free (kvcache/eviction.py's layout), its count, and this program's
    histogram column hist[:, pid] (for place's offsets; key-major, see category_lru_order).
    Nothing when sum(need_ptr[0:NEED_N]) == 0 (counts stay zero: place reads nothing else).
    Axis 1: the layer (key [L, S], hist [L, KEYS_PAD, programs], the rest by stride)."""
    lyr = tl.program_id(1).to(tl.int64)
    last_ptr += lyr * layer_slots
    owner_ptr += lyr * layer_slots
    resident_ptr += lyr * layer_scratch
    counts_ptr += lyr * layer_scratch
    key_ptr += lyr * S
    hist_ptr += lyr * KEYS_PAD * tl.num_programs(0)
    need_ptr += lyr * NEED_N
    if _sum_first(need_ptr, NEED_N, 1024) > 0:
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
        tl.store(hist_ptr + k * tl.num_programs(0) + tl.program_id(0), h)
        tl.atomic_add(counts_ptr + k, h, mask=(k < 2 * NUM_BUCKETS + 2) & (h > 0))


# sizes that change from step to step are not specialised on (== 1, % 16): a new size
# class would compile a variant mid-serving, which the start-up warm-up cannot foresee
@triton.jit(do_not_specialize=["NEED_N"])
def _place_kernel(key_ptr, counts_ptr, hist_ptr, need_ptr, out_ptr, S, NEED_N, layer_scratch,
                  NUM_KEYS: tl.constexpr, KEYS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """out[first positions] = slots, highest key first, as far as the `need` (= the sum of
    need_ptr[0:NEED_N]) victims reach: keys from the top while their first position is < need.
    The program's slots of key k go to above[k] + (slots of key k in earlier programs: the sum
    of victim_key's histogram row k over programs < pid) + their rank among them. No
    atomics: positions are exact and deterministic. Same BLOCK as victim_key. Axis 1: the
    layer (out [L, S])."""
    lyr = tl.program_id(1).to(tl.int64)
    key_ptr += lyr * S
    counts_ptr += lyr * layer_scratch
    hist_ptr += lyr * KEYS_PAD * tl.num_programs(0)
    need_ptr += lyr * NEED_N
    out_ptr += lyr * S
    pid = tl.program_id(0)
    s = pid * BLOCK + tl.arange(0, BLOCK)
    ok = s < S
    key = tl.load(key_ptr + s, mask=ok, other=-1)
    kidx = tl.arange(0, KEYS_PAD)
    counts = tl.load(counts_ptr + kidx, mask=kidx < NUM_KEYS, other=0)
    # first position of key k when keys are laid out from the highest down
    above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0)
    need = _sum_first(need_ptr, NEED_N, 1024)
    kk = NUM_KEYS - 1
    first = tl.sum(tl.where(kidx == kk, above, 0), axis=0)
    while (kk >= 0) & (first < need):
        mine = ok & (key == kk)
        local = tl.cumsum(mine.to(tl.int32), axis=0) - 1
        # only the few keys placed need their offset: no scan over every key and program
        base = _sum_first(hist_ptr + kk * tl.num_programs(0), pid, 1024)
        tl.device_assert(~mine | (first + base + local < S), "place: position out of range")
        tl.store(out_ptr + first + base + local, s.to(tl.int64), mask=mine)
        kk -= 1
        first = tl.sum(tl.where(kidx == kk, above, 0), axis=0)


def lru_scratch_size(num_rows: int, num_buckets: int) -> int:
    """int32 entries of category_lru_order's zeroed scratch: per-row residents [R] and per-key
    counts [2 * num_buckets + 2]."""
    return num_rows + 2 * num_buckets + 2


def category_lru_order(last_access, owner_row, row_quota, step, num_buckets: int,
                       need: torch.Tensor | None = None, scratch: torch.Tensor | None = None):
    """kvcache.eviction.victim_order(..., "category-lru") in three passes.
    last_access/owner_row [S] int64, row_quota [R] int64, step [] int64 -> [S] int64.
    need: [P] int32 on the device or None (all S): only the first sum(need) entries of the
    order are written (the rest is undefined); P > 1 is fused_retrieve's per-program miss
    counts. scratch: [lru_scratch_size(R, num_buckets)] int32, zeroed, or None (allocated
    and zeroed here); left dirty (fused_retrieve's assign zeroes it again).
    Several layers at once: last_access/owner_row [L, S] (rows of the cache's [L, S + 1]
    state, any row stride), need [L, P], scratch [L, size] (contiguous rows) -> [L, S], each
    layer's order on its own (one set of three launches for all of them)."""
    one = last_access.dim() == 1
    if one:
        last_access, owner_row = last_access.unsqueeze(0), owner_row.unsqueeze(0)
        need = None if need is None else need.unsqueeze(0)
        scratch = None if scratch is None else scratch.unsqueeze(0)
    L, S = last_access.shape
    assert owner_row.stride() == last_access.stride() and last_access.stride(1) == 1
    dev = last_access.device
    grid = (triton.cdiv(S, BLOCK), L)
    R = row_quota.shape[0]
    nk = 2 * num_buckets + 2
    if scratch is None:  # one zeroed buffer per layer: per-row residents, per-key counts
        scratch = torch.zeros((L, lru_scratch_size(R, num_buckets)), dtype=torch.int32,
                              device=dev)
    assert scratch.stride(1) == 1
    resident, counts = scratch[:, :R], scratch[:, R:R + nk]
    if need is None:
        need = torch.full((L, 1), S, dtype=torch.int32, device=dev)
    assert need.is_contiguous()
    ls, lz = last_access.stride(0), scratch.stride(0)
    _resident_kernel[grid](last_access, owner_row, resident, need, S, R, need.shape[1], ls, lz,
                           R_PAD=triton.next_power_of_2(R), BLOCK=BLOCK)
    key = torch.empty((L, S), dtype=torch.int32, device=dev)
    pad = triton.next_power_of_2(nk)
    # key-major [L, keys, programs]: place sums a key's row over its earlier programs
    hist = torch.empty((L, pad, grid[0]), dtype=torch.int32, device=dev)
    _victim_key_kernel[grid](last_access, owner_row, row_quota, resident, step, key, counts,
                             hist, need, S, need.shape[1], ls, lz, NUM_BUCKETS=num_buckets,
                             KEYS_PAD=pad, BLOCK=BLOCK)
    out = torch.empty((L, S), dtype=torch.int64, device=dev)
    _place_kernel[grid](key, counts, hist, need, out, S, need.shape[1], lz, NUM_KEYS=nk,
                        KEYS_PAD=pad, BLOCK=BLOCK)
    return out[0] if one else out
