"""Victim order for the device page cache, computed on the device with fixed shapes.

category-LRU (Spin): each slot's recency is bucketed (64 buckets of one step of age each;
everything older shares the last bucket), and victims come from the oldest non-empty bucket
first, in any order within a bucket — so the order is a counting sort over a few keys, not a
global sort (on the GPU the fused retrieve does it, kernels/retrieve.py; this torch version is
the CPU path and the kernels' reference). Plain LRU orders by exact
age with a full sort and is kept as the baseline. Free slots go first, then slots of requests
over their buffer quota, then the rest; slots used in the current step come last (the caller
never needs that many victims).
"""
from __future__ import annotations

import torch

NUM_BUCKETS = 64
EVICTION_POLICIES = ("category-lru", "lru")
# key layout (higher = evicted earlier): 0 used this step | 1..64 in quota | 65..128 over
# quota | 129 free
_NUM_KEYS = 2 * NUM_BUCKETS + 2


def victim_order(last_access: torch.Tensor, owner_row: torch.Tensor, row_quota: torch.Tensor,
                 step: torch.Tensor, policy: str) -> torch.Tensor:
    """Slots in the order they should be evicted.

    last_access [S] int64 step of last use (-1 = free slot); owner_row [S] int64 batch row
    owning the slot (scratch row when free); row_quota [R] int64 buffering quota per row;
    step [] int64 current step. Returns [S] int64 slot ids, best victim first."""
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; expected {EVICTION_POLICIES}")
    free = last_access < 0
    age = (step - last_access).clamp(min=0)
    # slots each row holds (scatter_add, not bincount: its output size would need a sync)
    resident = torch.zeros(row_quota.shape[0], dtype=torch.long, device=age.device)
    resident.scatter_add_(0, owner_row, (~free).long())
    over = (resident > row_quota)[owner_row] & ~free
    now = (age == 0) & ~free
    if policy == "lru":
        top = age.max() + 1  # device value: no sync
        key = torch.where(over, age + top, age)
        key = torch.where(free, 2 * top + 1, key)
        key = torch.where(now, torch.full_like(key, -1), key)
        return torch.sort(key, descending=True, stable=True).indices
    key = 1 + age.clamp(max=NUM_BUCKETS - 1) + over.long() * NUM_BUCKETS
    key = torch.where(free, _NUM_KEYS - 1, key)
    key = torch.where(now, 0, key)
    return torch.sort(key, descending=True, stable=True).indices
