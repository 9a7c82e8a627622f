"""The device page table as a chunk directory (first level of the two-level page table).

Per batch row and KV head the directory holds the ids of the request's page chunks
(KVCacheManager hands out `C = chunk_pages` consecutive page ids per chunk); block j of head h
is page ``chunks[row, h, j // C] * C + j % C``. The device keeps only the directory,
``[rows + 1, Hkv, cdiv(max_blocks, C)]`` int32 — C times smaller than a per-page table — and
derives page ids with a few element-wise ops per step (fixed shapes, no host sync: decode
steps stay capturable). A CPU mirror answers the saver's "which host page" without asking the
device. With C = 1 this is the plain per-page table.

The extra row is the scratch row (CUDA-graph padding lanes): every block of it derives the
scratch page id (derived ids are clamped to it, so no block of any row can name a page past
the tier).
"""
from __future__ import annotations

import numpy as np
import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PageDirectory:
    def __init__(self, rows: int, num_kv_heads: int, max_blocks: int, chunk_pages: int,
                 scratch_page: int, device: torch.device) -> None:
        C = self.chunk_pages = chunk_pages
        self.num_kv_heads = num_kv_heads
        self.max_blocks = max_blocks
        self.scratch_page = scratch_page
        self.scratch_row = rows
        n = cdiv(max_blocks, C)
        scratch_chunk = cdiv(scratch_page, C)  # derives ids >= scratch_page: clamped to it
        self.chunks = torch.zeros((rows + 1, num_kv_heads, n), dtype=torch.int32, device=device)
        self.chunks[rows] = scratch_chunk
        self.chunks_np = np.zeros((rows + 1, num_kv_heads, n), np.int32)  # CPU mirror
        self.chunks_np[rows] = scratch_chunk
        # within-chunk offset of every block the directory can name: [n * C]
        self._offset = (torch.arange(n * C, device=device) % C).to(torch.int32)

    # ---- device-side derivation (inside the step) -------------------------------------------
    def table(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Page ids of blocks [0, width) of each row: [B, Hkv, width] int32 (rows [B])."""
        C = self.chunk_pages
        if C == 1:
            return self.chunks[rows, :, :width]
        ch = self.chunks[rows, :, :cdiv(width, C)]  # [B, Hkv, n]
        pages = ch.repeat_interleave(C, dim=2)[:, :, :width] * C + self._offset[:width]
        return pages.clamp_(max=self.scratch_page)

    def pages_at(self, rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Page of block blocks[t] of row rows[t] for every KV head: [T, Hkv] int64."""
        C = self.chunk_pages
        heads = torch.arange(self.num_kv_heads, device=rows.device)
        cidx = torch.div(blocks, C, rounding_mode="floor")[:, None]
        ch = self.chunks[rows[:, None], heads[None, :], cidx]
        return (ch.long() * C + (blocks % C)[:, None]).clamp_(max=self.scratch_page)

    def row_range(self, row: int, b0: int, b1: int) -> torch.Tensor:
        """Pages of blocks [b0, b1) of one row: [Hkv, b1 - b0] int32."""
        C = self.chunk_pages
        c0, c1 = b0 // C, cdiv(b1, C)
        ch = self.chunks[row, :, c0:c1]
        pages = ch.repeat_interleave(C, dim=1) * C + self._offset[:(c1 - c0) * C]
        return pages[:, b0 - c0 * C:b1 - c0 * C].clamp_(max=self.scratch_page)

    # ---- host side --------------------------------------------------------------------------
    def host_pages(self, rows: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """CPU twin of pages_at: [T, Hkv] int64 from the mirror (no device access)."""
        C = self.chunk_pages
        ch = self.chunks_np[rows, :, blocks // C].astype(np.int64)
        return np.minimum(ch * C + (blocks % C)[:, None], self.scratch_page)

    def host_pages_span(self, row: int, start: int, n: int, ps: int) -> np.ndarray:
        """``host_pages`` of the blocks of one row's n consecutive tokens from ``start`` (a
        prefill chunk's positions; ``ps`` tokens a block): [n, Hkv] int64, looked up once per
        block and repeated over its tokens (a lookup per token took ~3 ms of host time a step
        at 32k tokens: engine.md, twenty-eighth session)."""
        b0, b1 = start // ps, -(-(start + n) // ps)
        blk = self.host_pages(np.full(b1 - b0, row), np.arange(b0, b1))
        s = start - b0 * ps
        return np.repeat(blk, ps, axis=0)[s:s + n]

    def step_host_pages(self, chunks, pos: np.ndarray, rows: np.ndarray, ps: int,
                        span=None) -> np.ndarray:
        """A step's save destinations [T, Hkv] int64: ``chunks`` with the decode ones first,
        ``pos`` / ``rows`` [T] their tokens' positions and rows in that order; the decode rows'
        looked up token by token, each prefill chunk's page by page (``host_pages_span``, or
        ``span(chunk)`` where given: a layer segment's kept one, worker/segment_plans.py)."""
        decode = [c for c in chunks if c.is_decode]
        nt = sum(c.num_tokens for c in decode)
        if span is None:
            def span(c):
                return self.host_pages_span(c.row, c.start, c.num_tokens, ps)
        return np.concatenate([self.host_pages(rows[:nt], pos[:nt] // ps)]
                              + [span(c) for c in chunks[len(decode):]])

    def write(self, rows: np.ndarray, heads: np.ndarray, chunk_idx: np.ndarray,
              values: np.ndarray, to_device) -> None:
        """chunks[rows, heads, chunk_idx] = values on both copies (one device scatter)."""
        self.chunks_np[rows, heads, chunk_idx] = values
        idx = [to_device(x, torch.long) for x in (rows, heads, chunk_idx)]
        self.chunks[idx[0], idx[1], idx[2]] = to_device(values, torch.int32)
