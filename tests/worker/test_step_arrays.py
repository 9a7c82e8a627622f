"""worker/step_arrays.step_token_arrays against the per-token Python lists it replaced: the same
ids, positions, rows and offsets for mixed steps at page-edge lengths; a layer segment past
layer 0 (its stream is saved hidden state) gets ids 0, the other chunks theirs."""
import numpy as np
import pytest

from sparseserve.engine.sched_output import ScheduledChunk
from sparseserve.request import PENDING_TOKEN
from sparseserve.worker.step_arrays import step_token_arrays


def chunk(row, start, ids, layer_start=0):
    return ScheduledChunk(request_id=f"r{row}", row=row, token_ids=list(ids), start=start,
                          layer_start=layer_start, layer_end=layer_start + 2, sample=True,
                          num_output_tokens=0)


def lists(chunks):
    ids, pos, rows, offsets, n = [], [], [], [], 0
    for c in chunks:
        ids.extend(c.token_ids)
        pos.extend(range(c.start, c.start + c.num_tokens))
        rows.extend([c.row] * c.num_tokens)
        offsets.append(n)
        n += c.num_tokens
    return ids, pos, rows, offsets


@pytest.mark.parametrize("lengths", [[1], [17], [1, 1, 54], [1, 97, 4097], [3, 1, 17, 54]])
def test_equals_the_lists(lengths):
    rng = np.random.default_rng(len(lengths))
    chunks = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, 128256, n).tolist()
        if n == 1:
            ids = [PENDING_TOKEN]  # a decode row fed from the device (async scheduling)
        chunks.append(chunk(row=7 - i, start=int(rng.integers(0, 9000)), ids=ids))
    ids, pos, rows, offsets = step_token_arrays(chunks)
    want = lists(chunks)
    for got, exp in zip((ids, pos, rows), want[:3]):
        assert got.dtype == np.int64 and got.tolist() == exp
    assert offsets == want[3] and all(type(o) is int for o in offsets)


def test_no_chunks():
    ids, pos, rows, offsets = step_token_arrays([])
    assert ids.shape == pos.shape == rows.shape == (0,) and offsets == []


@pytest.mark.parametrize("segment_at", [0, 1, 2])
def test_segments_past_layer_0_get_no_ids(segment_at):
    """Chunks of 1, 97 and 4097 tokens; the one at `segment_at` runs layers from 2 on: its ids
    are 0 (never embedded), every other chunk's and every position / row as the lists'."""
    rng = np.random.default_rng(segment_at)
    chunks = [chunk(row=r, start=int(rng.integers(0, 9000)),
                    ids=rng.integers(1, 128256, n).tolist(), layer_start=2 * (i == segment_at))
              for i, (r, n) in enumerate([(3, 1), (5, 97), (1, 4097)])]
    ids, pos, rows, offsets = step_token_arrays(chunks)
    want = lists(chunks)
    assert pos.tolist() == want[1] and rows.tolist() == want[2] and offsets == want[3]
    for c, off in zip(chunks, offsets):
        got = ids[off:off + c.num_tokens].tolist()
        assert got == ([0] * c.num_tokens if c.layer_start else c.token_ids)
