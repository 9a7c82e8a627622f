"""The per-token host arrays of a step (token ids, positions, rows), built with numpy.

A layer-segmented prompt is a chunk of its whole length at every step until its last layer
(a 57k-token prompt run two layers a step is a 57k-token chunk sixteen times), so these arrays
reach tens of thousands of tokens. Built as Python lists and turned into tensors with
`torch.tensor(list)` they took ~15 ms of host time at 57k tokens on the H100's host, before the
step's first kernel — idle GPU time in every such step (docs/results/engine.md, twenty-fifth
session); `np.arange` / `np.repeat` and one `np.fromiter` over the ids take ~2 ms on the
2-core CPU machine where the lists took ~26.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from sparseserve.engine.sched_output import ScheduledChunk


def step_token_arrays(chunks: Sequence[ScheduledChunk]
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """-> (ids int64 [T], positions int64 [T], rows int64 [T], offsets: the first token of
    each chunk in them, Python ints), T = the chunks' tokens in order. A chunk's positions are
    [start, start + num_tokens); its rows are its batch row; its ids are 0 when it starts past
    layer 0 (a layer segment: its stream is the saved hidden state, ids are not embedded;
    penalties and prompt logprobs read the chunk's own token_ids)."""
    counts = [c.num_tokens for c in chunks]
    total = sum(counts)
    offsets = list(itertools.accumulate(counts, initial=0))[:-1]
    embedded = [c.layer_start == 0 for c in chunks]
    if all(embedded):
        ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64,
                          total)
    else:  # a chunk past its first layer starts from its saved hidden state: ids unread, 0
        ids = np.zeros(total, np.int64)
        ids[np.repeat(np.array(embedded), counts)] = np.fromiter(
            itertools.chain.from_iterable(c.token_ids for c, e in zip(chunks, embedded) if e),
            np.int64, sum(n for n, e in zip(counts, embedded) if e))
    pos = np.concatenate([np.empty(0, np.int64)]  # no chunks: an empty array, not an error
                         + [np.arange(c.start, c.start + n, dtype=np.int64)
                            for c, n in zip(chunks, counts)])
    rows = np.repeat(np.fromiter((c.row for c in chunks), np.int64, len(chunks)), counts)
    return ids, pos, rows, offsets
