"""Working sets as SparseServe defines them: the pages a batch row selected within its last
`window` decode steps, resident on the device now or not (worker/offload_cache.py feeds it;
engine/slot_budget.py budgets by it).

Counting a row's recently used *resident* slots instead undercounts exactly when the cache is
short: an evicted page drops out of the count, the row's quota shrinks with it, and more of
its pages are evicted. So every host page carries the step it was last selected in, and each
host chunk (KVCacheManager's C consecutive pages of one request and KV head) its owning row.

Tensors (all on the device, fixed shapes, so stamping runs inside captured decode graphs):
* `last_selected` [L, n * C] int32, n = cdiv(host pages + 1, C): -1 when not selected in its
  request's life; the scratch page never stamped;
* `chunk_row` [n] int64: the owning batch row, the scratch row when free;
* `step` [] int32: the decode step (advanced with the cache's step).
"""
from __future__ import annotations

import torch


class SelectionStamps:
    def __init__(self, num_layers: int, num_host_pages: int, chunk_pages: int, num_rows: int,
                 device: torch.device) -> None:
        self.chunk_pages = C = chunk_pages
        self.scratch_page = num_host_pages
        self.scratch_row = num_rows
        self.num_rows = num_rows
        n_chunks = -(-(num_host_pages + 1) // C)
        self.last_selected = torch.full((num_layers, n_chunks * C), -1, dtype=torch.int32,
                                        device=device)
        self.chunk_row = torch.full((n_chunks,), num_rows, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.int32, device=device)

    def advance(self) -> None:
        self.step += 1

    def stamp(self, layer: int, pages: torch.Tensor, valid: torch.Tensor) -> None:
        """last_selected[layer, page] = this step for every valid entry of a decode selection:
        pages, valid [B, Hkv, K] (invalid entries stamp the scratch page, reset after)."""
        sel = torch.where(valid, pages.long(), self.scratch_page).reshape(-1)
        stamps = self.last_selected[layer]
        stamps.index_put_((sel,), self.step.expand(sel.shape))
        stamps[self.scratch_page].fill_(-1)

    def assign(self, rows: torch.Tensor, chunks: torch.Tensor) -> None:
        """Host chunks `chunks` [N] (pages chunk * C ... + C - 1) now belong to batch rows
        `rows` [N] (the worker's page-directory diff)."""
        self.chunk_row[chunks.long()] = rows.long()

    def forget(self, pages: torch.Tensor) -> None:
        """Pages [N] int64 left their request: no stamp, no owner (their ids are reused)."""
        # index_fill_: no CPU scalar copied to the device (no host sync)
        self.last_selected.index_fill_(1, pages, -1)
        self.chunk_row.index_fill_(0, torch.div(pages, self.chunk_pages, rounding_mode="floor"),
                                   self.scratch_row)

    def counts(self, window: int) -> torch.Tensor:
        """[L, num_rows + 1] int64: pages each row selected in the last `window` steps, per
        layer. One pass over every layer's stamps, a sum per chunk, a scatter by its row."""
        L, n = self.last_selected.shape
        sel = self.last_selected
        recent = (sel > self.step - window) & (sel >= 0)  # [L, n]
        per_chunk = recent.view(L, n // self.chunk_pages, self.chunk_pages).sum(-1)
        out = torch.zeros((L, self.num_rows + 1), dtype=torch.long, device=sel.device)
        return out.scatter_add_(1, self.chunk_row.expand(L, -1), per_chunk)
