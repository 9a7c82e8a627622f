"""Victim order for the device page cache, computed on the device with fixed shapes.

category-LRU (Spin): each slot's recency is bucketed (64 buckets of one step of age each;
everything older shares the last bucket; free slots rank before all of them), and victims come
from the oldest non-empty bucket first; within a bucket any order is fine. Plain LRU orders by
exact age and is kept as the baseline. Slots touched in the current step are never victims.
Slots of requests over their buffer quota rank before every in-quota slot.
"""
from __future__ import annotations

import torch

NUM_BUCKETS = 64
EVICTION_POLICIES = ("category-lru", "lru")


def victim_order(last_access: torch.Tensor, owner_row: torch.Tensor, row_quota: torch.Tensor,
                 step: torch.Tensor, policy: str) -> torch.Tensor:
    """Slots in the order they should be evicted.

    last_access [S] int64 step of last use (-1 = free slot); owner_row [S] int64 batch row
    owning the slot (scratch row when free); row_quota [R] int64 buffering quota per row;
    step [] int64 current step. Returns [S] int64 slot ids, best victim first; slots used in
    this step come last (the caller never takes that many)."""
    free = last_access < 0
    age = (step - last_access).clamp(min=0)
    if policy == "category-lru":
        key = age.clamp(max=NUM_BUCKETS - 1)
    elif policy == "lru":
        key = age
    else:
        raise ValueError(f"unknown eviction policy {policy!r}; expected {EVICTION_POLICIES}")
    top = key.max() + 1  # device value: no sync
    # slots each row holds (scatter_add, not bincount: its output size would need a sync)
    resident = torch.zeros(row_quota.shape[0], dtype=torch.float32, device=key.device)
    resident.scatter_add_(0, owner_row, (~free).to(torch.float32))
    over = (resident > row_quota.to(torch.float32))[owner_row] & ~free
    key = torch.where(over, key + top, key)
    key = torch.where(free, 2 * top + 1, key)
    key = torch.where((age == 0) & ~free, torch.full_like(key, -1), key)  # used this step
    return torch.sort(key, descending=True, stable=True).indices
