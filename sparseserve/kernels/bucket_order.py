"""Order slots by a small integer key, descending, without a sort (category LRU's core).

A counting sort with atomics: pass 1 counts slots per key, a tiny prefix sum over the keys
gives each key's first output position, pass 2 lets every slot claim the next position of its
key with an atomic increment. Slots of equal key land in arbitrary order (category LRU does not
care which of the oldest bucket's slots goes first). Two launches and an O(num_keys) scan,
fixed shapes, no host sync: capturable in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

BLOCK = 1024


@triton.jit
def _count_kernel(key_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    key = tl.load(key_ptr + offs, mask=ok, other=0)
    tl.atomic_add(counts_ptr + key, tl.full([BLOCK], 1, tl.int32), mask=ok)


@triton.jit
def _place_kernel(key_ptr, cursor_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    key = tl.load(key_ptr + offs, mask=ok, other=0)
    pos = tl.atomic_add(cursor_ptr + key, tl.full([BLOCK], 1, tl.int32), mask=ok)
    tl.store(out_ptr + pos, offs.to(tl.int64), mask=ok)


def bucket_order(key: torch.Tensor, num_keys: int) -> torch.Tensor:
    """key [S] int in [0, num_keys) -> [S] int64 indices, highest key first (ties: any order)."""
    n = key.shape[0]
    key = key.to(torch.int32).contiguous()
    counts = torch.zeros(num_keys, dtype=torch.int32, device=key.device)
    _count_kernel[(triton.cdiv(n, BLOCK),)](key, counts, n, BLOCK=BLOCK)
    return place_by_key(key, counts)


def place_by_key(key: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Second half of bucket_order: key [S] int32, counts [num_keys] int32 (slots per key)
    -> [S] int64 indices, highest key first."""
    n = key.shape[0]
    # first position of each key when keys are laid out from the highest down
    above = torch.flip(torch.cumsum(torch.flip(counts, [0]), 0), [0]) - counts
    cursor = above.to(torch.int32)
    out = torch.empty(n, dtype=torch.int64, device=key.device)
    _place_kernel[(triton.cdiv(n, BLOCK),)](key, cursor, out, n, BLOCK=BLOCK)
    return out
