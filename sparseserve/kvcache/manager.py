"""KVCacheManager: which pages each request owns (CPU bookkeeping, no device calls).

Pages are per KV head (the (H, N, D) layout): a request's token block j of KV head h lives
in page `page_table[j, h]`. Every block allocates `num_kv_heads` pages at once.
"""
from __future__ import annotations

import numpy as np

from sparseserve.kvcache.page_pool import PagePool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int) -> None:
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self._tables: dict[str, np.ndarray] = {}  # request id -> int32 [num_blocks, Hkv]

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        """Pages still to allocate so the request can hold num_tokens tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.page_size) - have) * self.num_kv_heads

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.pages_needed(request_id, num_tokens) <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int) -> tuple[int, np.ndarray]:
        """Grow the request to hold num_tokens tokens.

        Returns (first_new_block, new pages int32 [num_new_blocks, Hkv]); the caller sends
        this diff to the worker's device page table.
        """
        table = self._tables.get(request_id)
        have = 0 if table is None else len(table)
        n_new = max(0, cdiv(num_tokens, self.page_size) - have)
        new = self.pool.allocate(n_new * self.num_kv_heads).reshape(n_new, self.num_kv_heads)
        self._tables[request_id] = new if table is None else np.concatenate([table, new])
        return have, new

    def page_table(self, request_id: str) -> np.ndarray:
        return self._tables.get(request_id, np.empty((0, self.num_kv_heads), np.int32))

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table is not None and table.size:
            self.pool.free(table)

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_pages

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        owned = sum(t.size for t in self._tables.values())
        assert owned == self.pool.num_used, f"{owned} pages owned, {self.pool.num_used} used"
