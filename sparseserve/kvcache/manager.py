"""KVCacheManager: which pages each request owns (CPU bookkeeping, no device calls).

Pages are per KV head (the (H, N, D) layout): a request's token block j of KV head h lives
in page `page_table[j, h]`. Pages are handed out in **chunks** of `chunk_pages` consecutive
page ids per (request, KV head): block j of head h is page ``chunks[j // C, h] * C + j % C``.
The chunk table is the first level of the page table (DESIGN.md §5): the worker keeps only
it on the device (C times smaller than a per-page table) and derives page ids from it; the
per-page view exists on demand (`page_table`). With the two-tier cache a chunk is also a
contiguous run of DRAM pages, so a prefill's pages of one head are saved in long runs.
`chunk_pages=1` is the plain per-page table (the all-resident engine: no rounding waste in
HBM).
"""
from __future__ import annotations

import numpy as np

from sparseserve.kvcache.page_pool import PagePool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_chunks(chunks: np.ndarray, chunk_pages: int, num_blocks: int) -> np.ndarray:
    """Chunk table int32 [num_chunks, Hkv] -> page table int32 [num_blocks, Hkv]."""
    C = chunk_pages
    if C == 1:
        return chunks[:num_blocks]
    pages = np.repeat(chunks, C, axis=0).astype(np.int64) * C
    pages += (np.arange(pages.shape[0]) % C)[:, None]
    return pages[:num_blocks].astype(np.int32)


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int,
                 chunk_pages: int = 1) -> None:
        if chunk_pages < 1 or num_pages < chunk_pages:
            raise ValueError(f"chunk_pages={chunk_pages} must be in [1, num_pages={num_pages}]")
        # whole chunks only: the pages past the last whole chunk are never handed out
        self.pool = PagePool(num_pages // chunk_pages)
        self.chunk_pages = chunk_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self._chunks: dict[str, np.ndarray] = {}  # request id -> int32 [num_chunks, Hkv]
        self._blocks: dict[str, int] = {}  # request id -> blocks (pages per head) in use

    @property
    def num_pages(self) -> int:
        """Pages the pool can hand out (whole chunks)."""
        return self.pool.num_pages * self.chunk_pages

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free * self.chunk_pages

    def _chunks_needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self._chunks.get(request_id, ()))
        return max(0, cdiv(cdiv(num_tokens, self.page_size), self.chunk_pages) - have)

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        """Pages still to allocate so the request can hold num_tokens tokens."""
        return self._chunks_needed(request_id, num_tokens) * self.num_kv_heads * self.chunk_pages

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return (self._chunks_needed(request_id, num_tokens) * self.num_kv_heads
                <= self.pool.num_free)

    def allocate(self, request_id: str, num_tokens: int) -> tuple[int, np.ndarray]:
        """Grow the request to hold num_tokens tokens.

        Returns (first_new_chunk, new chunk ids int32 [num_new_chunks, Hkv]); the caller sends
        this diff to the worker's device chunk table."""
        table = self._chunks.get(request_id)
        have = 0 if table is None else len(table)
        n_new = self._chunks_needed(request_id, num_tokens)
        new = self.pool.allocate(n_new * self.num_kv_heads).reshape(n_new, self.num_kv_heads)
        self._chunks[request_id] = new if table is None else np.concatenate([table, new])
        self._blocks[request_id] = max(self._blocks.get(request_id, 0),
                                       cdiv(num_tokens, self.page_size))
        return have, new

    def chunk_table(self, request_id: str) -> np.ndarray:
        """int32 [num_chunks, Hkv] chunk ids of the request."""
        return self._chunks.get(request_id, np.empty((0, self.num_kv_heads), np.int32))

    def page_table(self, request_id: str) -> np.ndarray:
        """int32 [num_blocks, Hkv] page ids of the request's blocks in use (built on demand)."""
        return expand_chunks(self.chunk_table(request_id), self.chunk_pages,
                             self._blocks.get(request_id, 0))

    def free(self, request_id: str) -> None:
        table = self._chunks.pop(request_id, None)
        self._blocks.pop(request_id, None)
        if table is not None and table.size:
            self.pool.free(table)

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_pages

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        owned = sum(t.size for t in self._chunks.values())
        assert owned == self.pool.num_used, f"{owned} chunks owned, {self.pool.num_used} used"
