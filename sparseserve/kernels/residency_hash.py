"""Residency index of the device page cache: host page -> device slot, sized by the slots.

A flat map (one entry per host page and layer) grows with the host tier — the address
space; this index grows with the device cache — the working set (DESIGN.md §5). It is an
open-addressing hash table with linear probing, one per layer: ``table [H]`` int32 holds slot
ids or -1 (empty), ``H`` a power of two >= 2 x slots (load <= 1/2). A slot's key is not
stored in the table: it is ``page_of[slot]`` (the cache's reverse map, the source of truth),
so the table is 4 bytes per entry and can never disagree with the cache about a key.

Entries are never deleted one by one. When a slot is remapped (a victim takes a new page), the
new mapping is inserted (``insert_slots``, from the retrieve kernel) and the entry of the old
page stays behind, stale: it names a slot whose key is now another page, so a lookup of the
old page compares, moves on and ends at an empty entry — a miss, as it must be — and a lookup
that meets it for the new page finds the right slot. Entries only ever go from empty to full
between builds, so a key placed at position x had every position from its hash to x - 1
occupied, and a lookup that probes until it meets the key or an empty entry finds it —
whatever order parallel inserts ran in. ``fill [2]`` int64 counts the table's entries (live +
stale); ``rebuild_if_full`` rebuilds from ``page_of`` (clear + insert every mapped slot: O(slots)
work) only when they exceed half the table, so the load stays <= 1/2 (H >= 4 x slots: at least
`slots` remaps between rebuilds) and a step with few misses pays three near-empty launches
instead of a rebuild. ``rebuild`` rebuilds unconditionally (slots freed by the host).

Triton kernels (GPU, or CPU tensors in Triton's interpreter) and torch versions with the same
contract (the CPU engine path; the reference of the tests). No host sync in the kernels:
capturable in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["table_size", "hash_pages", "rebuild", "rebuild_if_full", "lookup", "lookup_layers",
           "insert_slots"]

BLOCK = 256
_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27: x * _MIX stays below 2**59 for x < 2**32 (no int64 overflow)


def table_size(num_slots: int) -> int:
    """Entries of one layer's table: a power of two >= 4 x num_slots (live + stale entries are
    kept <= 1/2 of it, so at least num_slots remaps fit between two rebuilds)."""
    return max(16, triton.next_power_of_2(4 * max(1, num_slots)))


def hash_pages(pages: torch.Tensor, mask: int) -> torch.Tensor:
    """Home position of each page id (>= 0): [N] int64 in [0, mask]. Integer mixing so that
    consecutive page ids (a chunk) spread over the table."""
    x = pages.long() & _M32
    x = ((x >> 16) ^ x) * _MIX & _M32
    x = ((x >> 16) ^ x) * _MIX & _M32
    x = (x >> 16) ^ x
    return x & mask


@triton.jit
def _hash(p, mask):
    x = p & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return x & mask


@triton.jit
def insert_slots(table_ptr, p, slot, pending, mask):
    """Insert slot [BLOCK] int32 under page p [BLOCK] int64 for the `pending` lanes (the
    caller counts them into fill): claim the first empty entry from the page's home."""
    pos = _hash(tl.maximum(p, 0), mask)
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        # lanes not pending compare against -2, which never matches: no write
        cmp = tl.where(pending, -1, -2).to(tl.int32)
        old = tl.atomic_cas(table_ptr + pos, cmp, slot)
        placed = pending & (old == -1)
        pending = pending & ~placed
        pos = tl.where(pending, (pos + 1) & mask, pos)


@triton.jit
def _due(fill_ptr, H, FORCE: tl.constexpr):
    """A rebuild is due: forced, or the entries (live + stale) exceed half the table."""
    if FORCE:
        due = tl.full((), 1, tl.int1)
    else:
        due = tl.load(fill_ptr) > H // 2
    return due


# program_id(1) is the layer: one launch serves one table or every layer's ([L, H] tables,
# [L, S] reverse maps, [L, 2] fill counts; strides in elements). Callers pass one layer's row
# or a layer range (layer-segmented prefill), so the pointers' alignment varies with the layer:
# not specialised on (a new class would compile mid-serving; hash probes gain nothing from it)
@triton.jit(do_not_specialize_on_alignment=["table_ptr", "fill_ptr"])
def _clear_kernel(table_ptr, fill_ptr, H, stride_t, FORCE: tl.constexpr, BLOCK: tl.constexpr):
    """table = -1 when a rebuild is due."""
    layer = tl.program_id(1).to(tl.int64)
    if _due(fill_ptr + 2 * layer, H, FORCE):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(table_ptr + layer * stride_t + i, tl.full((BLOCK,), -1, tl.int32),
                 mask=i < H)


@triton.jit(do_not_specialize_on_alignment=["table_ptr", "page_of_ptr", "fill_ptr"])
def _rebuild_kernel(table_ptr, page_of_ptr, fill_ptr, S, H, mask, stride_t, stride_p,
                    FORCE: tl.constexpr, BLOCK: tl.constexpr):
    """When a rebuild is due: insert every slot s < S with page_of[s] >= 0 into the cleared
    table; fill[1] += entries inserted."""
    layer = tl.program_id(1).to(tl.int64)
    fill = fill_ptr + 2 * layer
    if _due(fill, H, FORCE):
        s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        p = tl.load(page_of_ptr + layer * stride_p + s, mask=s < S, other=-1).to(tl.int64)
        pending = p >= 0
        tl.atomic_add(fill + 1, tl.sum(pending.to(tl.int64), axis=0))
        insert_slots(table_ptr + layer * stride_t, p, s.to(tl.int32), pending, mask)


@triton.jit(do_not_specialize_on_alignment=["fill_ptr"])
def _finish_kernel(fill_ptr, H, FORCE: tl.constexpr):
    """After a rebuild the table holds exactly the inserted entries."""
    fill = fill_ptr + 2 * tl.program_id(0).to(tl.int64)
    if _due(fill, H, FORCE):
        tl.store(fill, tl.load(fill + 1))
        tl.store(fill + 1, 0)


@triton.jit
def probe_slots(table_ptr, page_of_ptr, p, active, mask, BLOCK: tl.constexpr):
    """Slot of page p [BLOCK] int64 for the `active` lanes (-1: not resident): probe from the
    page's home until its slot or an empty entry (stale entries fail the key check)."""
    pos = _hash(tl.maximum(p, 0), mask)
    res = tl.full((BLOCK,), -1, tl.int64)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        s = tl.load(table_ptr + pos, mask=active, other=-1)
        full = active & (s >= 0)
        key = tl.load(page_of_ptr + tl.maximum(s, 0), mask=full, other=-1)
        found = full & (key == p)
        res = tl.where(found, s.to(tl.int64), res)
        active = full & ~found
        pos = tl.where(active, (pos + 1) & mask, pos)
    return res


# sizes that change from step to step are not specialised on (== 1, % 16), nor pointers'
# alignment (a layer's row, a slice of page ids): a new class would compile a variant
# mid-serving, which the start-up warm-up cannot foresee
@triton.jit(do_not_specialize=["N"],
            do_not_specialize_on_alignment=["table_ptr", "page_of_ptr", "pages_ptr", "out_ptr"])
def _lookup_kernel(table_ptr, page_of_ptr, pages_ptr, out_ptr, N, mask, stride_t, stride_p,
                   BLOCK: tl.constexpr):
    """out[layer, i] = slot of pages[i] in layer program_id(1)'s table."""
    layer = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(pages_ptr + i, mask=i < N, other=-1).to(tl.int64)
    res = probe_slots(table_ptr + layer * stride_t, page_of_ptr + layer * stride_p, p, p >= 0,
                      mask, BLOCK)
    tl.store(out_ptr + layer * N + i, res, mask=i < N)


def rebuild(table: torch.Tensor, page_of: torch.Tensor, fill: torch.Tensor | None = None, *,
            backend: str | None = None) -> None:
    """Rebuild one layer's table from the reverse map.

    table:   [H] int32, H a power of two (``table_size``); overwritten
    page_of: [S] int64  page held by each slot, -1 = free (every mapped page at most once)
    fill:    [2] int64 or None: the table's entry count (set to the mapped slots)
    """
    _rebuild(table, page_of, fill, True, backend)


def rebuild_if_full(table: torch.Tensor, page_of: torch.Tensor, fill: torch.Tensor, *,
                    backend: str | None = None) -> None:
    """``rebuild`` only if the table's entries (fill[0], live + stale) exceed half of it;
    decided on the device (no sync, capturable). Several layers at once: table [L, H],
    page_of [L, S], fill [L, 2] (three launches for all of them), each decided on its own."""
    _rebuild(table, page_of, fill, False, backend)


def _rebuild(table, page_of, fill, force: bool, backend: str | None) -> None:
    if table.dim() == 1:
        table, page_of = table.unsqueeze(0), page_of.unsqueeze(0)
        fill = None if fill is None else fill.unsqueeze(0)
    L, H = table.shape
    assert H & (H - 1) == 0 and page_of.shape[1] <= H // 2
    assert table.stride(1) == 1 and page_of.stride(1) == 1
    if _backend(table, backend) == "torch":
        for layer in range(L):  # the CPU path rebuilds every time (no device-side branch)
            table[layer].fill_(-1)
            _torch_rebuild(table[layer], page_of[layer])
            if fill is not None:
                fill[layer, 0] = (page_of[layer] >= 0).sum()
                fill[layer, 1] = 0
        return
    if fill is None:
        fill = torch.zeros((L, 2), dtype=torch.int64, device=table.device)
    assert fill.is_contiguous()
    S = page_of.shape[1]
    _clear_kernel[(triton.cdiv(H, 1024), L)](table, fill, H, table.stride(0), FORCE=force,
                                             BLOCK=1024)
    _rebuild_kernel[(triton.cdiv(S, BLOCK), L)](table, page_of, fill, S, H, H - 1,
                                                table.stride(0), page_of.stride(0),
                                                FORCE=force, BLOCK=BLOCK)
    _finish_kernel[(L,)](fill, H, FORCE=force)


def lookup(table: torch.Tensor, page_of: torch.Tensor, pages: torch.Tensor, *,
           backend: str | None = None) -> torch.Tensor:
    """Slot holding each page: [N] int64, -1 where the page is not resident or pages[i] < 0.

    table [H] int32 (built by ``rebuild`` from page_of); page_of [S] int64; pages [N] int."""
    return lookup_layers(table.unsqueeze(0), page_of.unsqueeze(0), pages, backend=backend)[0]


def lookup_layers(table: torch.Tensor, page_of: torch.Tensor, pages: torch.Tensor, *,
                  backend: str | None = None) -> torch.Tensor:
    """``lookup`` in every layer at once (one launch): table [L, H] int32, page_of [L, S]
    int64, pages [N] int -> [L, N] int64 (-1: not resident in that layer, or pages[i] < 0)."""
    pages = pages.contiguous()
    if _backend(table, backend) == "torch":
        return torch.stack([_torch_lookup(t, p, pages) for t, p in zip(table, page_of)])
    assert table.stride(1) == 1 and page_of.stride(1) == 1
    L, N = table.shape[0], pages.shape[0]
    out = torch.empty((L, N), dtype=torch.int64, device=pages.device)
    if N and L:
        _lookup_kernel[(triton.cdiv(N, BLOCK), L)](table, page_of, pages, out, N,
                                                   table.shape[1] - 1, table.stride(0),
                                                   page_of.stride(0), BLOCK=BLOCK)
    return out


def _backend(t: torch.Tensor, backend: str | None) -> str:
    if backend is not None:
        return backend
    return "triton" if t.is_cuda else "torch"


def _torch_rebuild(table: torch.Tensor, page_of: torch.Tensor) -> None:
    """Same result class as the kernel: every mapped slot reachable from its page's home."""
    mask = table.shape[0] - 1
    slot = torch.nonzero(page_of >= 0).flatten()
    pos = hash_pages(page_of[slot], mask)
    while slot.numel():
        free = table[pos] < 0
        cand_slot, cand_pos = slot[free], pos[free]
        table[cand_pos] = cand_slot.to(table.dtype)  # duplicates: one of them wins
        won = torch.zeros_like(free)
        won[free] = table[cand_pos] == cand_slot.to(table.dtype)
        slot, pos = slot[~won], (pos[~won] + 1) & mask


def _torch_lookup(table: torch.Tensor, page_of: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    mask = table.shape[0] - 1
    pages = pages.long()
    res = torch.full_like(pages, -1)
    idx = torch.nonzero(pages >= 0).flatten()
    pos = hash_pages(pages[idx], mask)
    while idx.numel():
        s = table[pos].long()
        full = s >= 0
        found = full & (page_of[s.clamp(min=0)] == pages[idx])
        res[idx[found]] = s[found]
        go = full & ~found
        idx, pos = idx[go], (pos[go] + 1) & mask
    return res
