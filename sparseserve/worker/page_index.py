"""Summaries of pages gathered out of place (the two-tier cache's indexing: the pages' K sits
in device slots or in the step's projection, their summaries belong at host page ids), shared
by the eager two-tier context (offload_context.py) and the captured two-tier prefill layers
(two_tier_graphs.py)."""
from __future__ import annotations

import torch

from sparseserve.sparse import LayerSummaries


def index_pages(algo, scratch_page: int, k_pages: torch.Tensor, read_ids: torch.Tensor,
                host_ids: torch.Tensor, ntok: torch.Tensor, summaries: LayerSummaries,
                queries: torch.Tensor | None, v_pages: torch.Tensor | None = None) -> None:
    """index() reads and writes the same row ids; here page i of k_pages [n, ps, D] (and
    of v_pages, for an algorithm that ``uses_values``) is
    summarised (read_ids[i] = i, or -1: skipped) and its summary belongs at host_ids[i]
    [n] int64 (the scratch page for skipped entries), so go through a scratch table of
    n + 1 rows — the last is where index() sends skipped lanes, so they never share a row
    with a summarised page (a race on that row otherwise) — one zeroed buffer for all
    summary tensors, one index_copy_ each, one zeroing of the scratch page's rows (the
    skipped entries' copies all land there). An algorithm that ``indexes_apart`` writes
    at host_ids itself instead. Fixed shapes, no host sync: capturable."""
    n = read_ids.shape[0]
    tensors = summaries.tensors
    if not tensors:  # an algorithm without summaries (streaming) indexes nothing
        return
    if algo.indexes_apart and not (algo.uses_values or algo.uses_queries):
        # it writes page i's summary at host_ids[i] itself: no scratch table, no copies
        algo.index(k_pages, read_ids, ntok, summaries, None, write_ids=host_ids)
        return
    # the scratch table's rows are pages, and so are the copies below: a layout that
    # interleaves pages' rows writes in place instead (indexes_apart)
    assert summaries.interleave == 1, f"{type(algo).__name__}: interleaved summaries " \
        "need indexes_apart (index(write_ids=))"
    scratch = LayerSummaries(_zeros_like_rows(tensors, n + 1), summaries.shapes)
    values = {"v_cache": v_pages} if algo.uses_values else {}
    algo.index(k_pages, read_ids, ntok, scratch, queries if algo.uses_queries else None,
               **values)
    for name, t in tensors.items():
        t.index_copy_(0, host_ids, scratch[name][:n])
    torch._foreach_zero_([t[scratch_page] for t in tensors.values()])


def _zeros_like_rows(tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Zeroed [n, width] tensors shaped like each summary's rows, carved out of one buffer per
    dtype (one fill launch instead of one per summary); each is contiguous."""
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    for dtype, names in by_dtype.items():
        sizes = [n * tensors[m].shape[1] for m in names]
        flat = torch.zeros(sum(sizes), dtype=dtype, device=tensors[names[0]].device)
        for m, part in zip(names, flat.split(sizes)):
            out[m] = part.view(n, tensors[m].shape[1])
    return out
