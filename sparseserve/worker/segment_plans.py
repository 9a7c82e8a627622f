"""A layer-segmented prompt's per-request host plans, shared by its segment steps.

With layer-segmented prefill a long prompt runs as one chunk of its whole length over several
steps, a few layers each (a 32k-token prompt on Llama-3-8B: 16 steps of 2 layers). Every such
step used to rebuild, from the same (row, start, tokens, page directory), the same O(prompt)
host plans: the chunk's save destinations and their ``SavePlan`` (whose ``cache`` keeps their
device copies), and the offload context's ``_prefill_plan`` arrays with their one
host-to-device copy (~2.3 ms a step at 32k tokens on the CPU machine; engine.md, twenty-ninth
session). Only the layers change. ``SegmentPlans`` keeps them per request (mechanism of the
runner: what to run stays the scheduler's) and hands them to the next segment step of the same
chunk, built lazily by the context that first needs them (``ChunkPlans``).

A stale hit would save K/V to the wrong host pages (silently wrong answers), so an entry is
reused only by the very next segment of the same chunk: the same request, row, start, token
count, slot-free flag and resident pages (the scheduler sets these again every step), no chunk
allocated this step, the directory entries of the chunk's pages equal to a snapshot taken when
the entry was made, and its layers starting where the entry's last segment ended. Anything
else builds a fresh entry. Entries go at the chunk's last segment (the step uses it, it is not
kept) and when the runner releases the request (finished, aborted, preempted).

The cached device tensors are the plans' own (``pack_to_device`` and ``SavePlan.on_device``
allocate them per plan; no staging ring or static buffer is reused under them), read-only to
every kernel and saver that takes them (each step's layers already shared them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparseserve.engine.sched_output import ScheduledChunk
from sparseserve.worker.page_directory import PageDirectory, cdiv

__all__ = ["ChunkPlans", "SegmentPlans"]


@dataclass
class ChunkPlans:
    """One prefill chunk's plans that are the same at every segment step (None: not built
    yet; the first context that needs one builds and stores it). ``save_plan``: the SavePlan of
    the chunk's rows alone (a context whose saved rows are this chunk's only); ``span``: the
    chunk's save destinations [n, Hkv] (for a context of several chunks' rows);
    ``prefill``: OffloadForwardContext's _prefill_plan without what depends on the chunk's
    place in a step (its rows)."""
    key: tuple
    directory: np.ndarray  # the chunk's page-directory entries when made [Hkv, chunks]
    layer_end: int  # where the last segment that used it ended
    save_plan: object = None
    span: np.ndarray | None = None
    prefill: dict | None = None


class SegmentPlans:
    """Per request id: the ChunkPlans of its layer-segmented chunk (see the module docstring).
    ``builds`` / ``hits``: entries made / reused (for tests and benchmarks)."""

    def __init__(self, pages: PageDirectory, page_size: int, num_layers: int) -> None:
        self.pages = pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.entries: dict[str, ChunkPlans] = {}
        self.builds = 0
        self.hits = 0

    def for_step(self, chunks: list[ScheduledChunk]) -> dict[str, ChunkPlans]:
        """The step's entries by request id, for its prefill chunks (call once a step, after
        the step's page diffs are in the directory). A chunk that runs all its layers in this
        step gets a fresh one, kept for the step only (its layer intervals' contexts share it)."""
        return {c.request_id: self._entry(c) for c in chunks if not c.is_decode}

    def _entry(self, c: ScheduledChunk) -> ChunkPlans:
        key = (c.row, c.start, c.num_tokens, bool(c.slot_free), int(c.resident_pages))
        nb = cdiv(c.start + c.num_tokens, self.page_size)
        snap = self.pages.chunks_np[c.row, :, :cdiv(nb, self.pages.chunk_pages)]
        e = self.entries.pop(c.request_id, None)
        if not (e is not None and c.layer_start > 0 and e.layer_end == c.layer_start
                and e.key == key and not c.new_chunks.size
                and np.array_equal(e.directory, snap)):
            e = ChunkPlans(key, snap.copy(), c.layer_end)
            self.builds += 1
        else:
            self.hits += 1
        e.layer_end = c.layer_end
        if c.layer_end < self.num_layers:  # the last segment uses it; nothing after it does
            self.entries[c.request_id] = e
        return e

    def save_dest(self, chunks: list[ScheduledChunk], pos: np.ndarray, rows: np.ndarray,
                  step: dict[str, ChunkPlans]) -> tuple[np.ndarray, np.ndarray]:
        """A context's save destinations: PageDirectory.step_host_pages (``chunks`` decode
        first, ``pos`` / ``rows`` their tokens') with the spans of the chunks in ``step`` (the
        step's entries) built once a chunk, and the offsets ``pos % page_size``."""
        ps = self.page_size

        def span(c: ScheduledChunk) -> np.ndarray:
            e = step.get(c.request_id)
            got = e.span if e is not None else None
            if got is None:
                got = self.pages.host_pages_span(c.row, c.start, c.num_tokens, ps)
                if e is not None:
                    e.span = got
            return got
        return self.pages.step_host_pages(chunks, pos, rows, ps, span), pos % ps

    def release(self, request_ids) -> None:
        """Forget finished / aborted / preempted requests' entries."""
        for rid in request_ids:
            self.entries.pop(rid, None)
