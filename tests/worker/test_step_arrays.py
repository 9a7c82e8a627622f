"""worker/step_arrays.step_token_arrays against the per-token Python lists it replaced: the same
ids, positions, rows and offsets for mixed steps at page-edge lengths."""
import numpy as np
import pytest

from sparseserve.engine.sched_output import ScheduledChunk
from sparseserve.request import PENDING_TOKEN
from sparseserve.worker.step_arrays import step_token_arrays


def chunk(row, start, ids):
    return ScheduledChunk(request_id=f"r{row}", row=row, token_ids=list(ids), start=start,
                          layer_start=0, layer_end=2, sample=True, num_output_tokens=0)


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
