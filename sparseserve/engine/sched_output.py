"""What the scheduler hands the worker each step (plain data: the worker never sees
engine objects). Page tables travel as diffs: only newly allocated pages."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sparseserve.request import SamplingParams


@dataclass
class NewRow:
    """A request taking a batch row (first schedule, or again after preemption)."""

    row: int
    request_id: str
    params: SamplingParams
    # token ids the sampler forbids while the request has fewer than params.min_tokens output
    # tokens (Request.min_tokens_stop_ids); () without min_tokens
    min_tokens_stop_ids: tuple[int, ...] = ()


@dataclass
class ScheduledChunk:
    """Tokens [start, start + len(token_ids)) of one request, over layers [layer_start, layer_end)."""

    request_id: str
    row: int
    token_ids: list[int]
    start: int  # position of token_ids[0] (= tokens already in the KV cache)
    layer_start: int
    layer_end: int
    sample: bool  # this chunk completes the request's known tokens: sample the next one
    num_output_tokens: int  # output tokens so far (seeded sampling derives its stream from it)
    # chunk-table diff (see KVCacheManager): chunks [first_new_chunk, first_new_chunk + n)
    first_new_chunk: int = 0
    new_chunks: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.int32))  # [n, Hkv]
    # a whole prompt under layer-segmented prefill with saves ordered on the device: its pages
    # take no device slot (attention reads the projection's K/V; they reach DRAM by the saver,
    # fenced before any load of them; the first decode step loads what it selects)
    slot_free: bool = False
    # pages per KV head of a slot-free prompt kept resident anyway, its newest ones: slots the
    # step's reservations left spare (the scheduler's choice), so a lightly loaded cache still
    # starts the request's decode warm; 0 under pressure
    resident_pages: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0 and self.layer_start == 0 and self.sample


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    new_rows: list[NewRow] = field(default_factory=list)
    freed_rows: list[int] = field(default_factory=list)  # rows whose request left (finished/preempted)
    freed_request_ids: list[str] = field(default_factory=list)  # their requests: drop worker state
    freed_pages: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))  # back in the pool
    num_layers: int = 0
    # two-tier cache: per-row slot quotas [max_num_seqs + 1] int64 (engine/slot_budget.py)
    row_quotas: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def layer_intervals(chunks: list[ScheduledChunk]) -> list[tuple[int, int]]:
    """Split the layer axis where the set of active chunks changes."""
    cuts = sorted({c.layer_start for c in chunks} | {c.layer_end for c in chunks})
    return list(zip(cuts[:-1], cuts[1:]))


def decode_fills(decode_chunks: list[ScheduledChunk], page_size: int) -> bool:
    """Whether a decode token of this step completes its page (token at position p fills it
    when p + 1 is a multiple of page_size): only then are filled pages indexed (see
    OffloadForwardContext.decode_fills)."""
    return any((c.start + 1) % page_size == 0 for c in decode_chunks)
