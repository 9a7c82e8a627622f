"""Pinned host memory for the two-tier cache: the host tier at its exact size, and the size of
FlashD2H's staging ring."""
from __future__ import annotations

import torch


def staging_ring_bytes(step_save_bytes: int, floor: int = 1 << 30,
                       cap: int = 8 << 30) -> int:
    """FlashD2H's pinned staging ring: two steps of prefill saves (the fence lags one step),
    at least `floor`, at most `cap` (pinned host memory beside the host tier), rounded up
    to 64 MiB."""
    want = min(max(2 * step_save_bytes, floor), cap)
    return -(-want // (64 << 20)) * (64 << 20)


def unregister_pinned(ptr: int) -> None:
    """Undo alloc_pinned's registration (before the memory goes back to the OS)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


def alloc_pinned(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory, page-locked when `pin`. torch's pinned allocator rounds each allocation up
    to a power of two (a 32 GiB tier plus one scratch page would lock 64 GiB), so allocate
    pageable memory of the exact size and register it with CUDA instead."""
    t = torch.empty(shape, dtype=dtype)
    if not pin:
        return t
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(getattr(rc, "value", rc)) == 0 and t.is_pinned():
        return t
    return t.pin_memory()  # registration unavailable: fall back to the caching allocator
