"""A pool of page ids with a free list and reference counts (CPU bookkeeping only).

A page id names one page frame: `page_size` tokens of one KV head, at the same index in
every layer's K and V tensors (the worker owns those tensors).
"""
from __future__ import annotations

import numpy as np


class OutOfPagesError(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"A page pool needs at least one page, got {num_pages}.")
        self.num_pages = num_pages
        self.refcounts = np.zeros(num_pages, dtype=np.int32)
        # LIFO free list: recently freed pages are reused first (warm in caches)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> np.ndarray:
        """Take n pages (refcount 1 each) -> int32 [n]; raises OutOfPagesError if short."""
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        if n == 0:
            return np.empty(0, dtype=np.int32)
        pages = np.array(self._free[-n:][::-1], dtype=np.int32)
        del self._free[-n:]
        self.refcounts[pages] = 1
        return pages

    def incref(self, pages: np.ndarray) -> None:
        if np.any(self.refcounts[pages] <= 0):
            raise RuntimeError("incref of a free page")
        np.add.at(self.refcounts, pages, 1)

    def free(self, pages: np.ndarray) -> None:
        """Drop one reference from each page; pages reaching zero go back to the free list."""
        pages = np.asarray(pages, dtype=np.int64).ravel()
        if np.any(self.refcounts[pages] <= 0):
            raise RuntimeError("double free of a page")
        np.subtract.at(self.refcounts, pages, 1)
        released = pages[self.refcounts[pages] == 0]
        self._free.extend(np.unique(released).tolist())

    def check_invariants(self) -> None:
        """Free list and refcounts agree: every page is free xor referenced, none twice."""
        free = np.array(self._free, dtype=np.int64)
        assert len(np.unique(free)) == len(free), "page on the free list twice"
        assert np.all(self.refcounts[free] == 0), "free page still referenced"
        assert int((self.refcounts > 0).sum()) + len(free) == self.num_pages, "leaked page"
        assert np.all(self.refcounts >= 0)
