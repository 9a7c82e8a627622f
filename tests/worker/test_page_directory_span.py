"""worker/page_directory.PageDirectory.host_pages_span (a prefill chunk's save destinations,
looked up per page) == host_pages looked up per token, for chunks that start and end off page
and off directory-chunk edges, with chunk ids past the host pool clamped to the scratch page."""
import numpy as np
import pytest
import torch

from sparseserve.worker.page_directory import PageDirectory

PS, C, HKV, SCRATCH = 32, 16, 3, 5000


@pytest.fixture
def directory():
    d = PageDirectory(rows=4, num_kv_heads=HKV, max_blocks=300, chunk_pages=C,
                      scratch_page=SCRATCH, device=torch.device("cpu"))
    rng = np.random.default_rng(0)
    d.chunks_np[:4] = rng.integers(0, SCRATCH // C + 3, d.chunks_np[:4].shape)  # some past it
    return d


@pytest.mark.parametrize("start,n", [(0, 1), (0, 17), (5, 54), (31, 97), (511, 4097),
                                     (1000, 32), (32 * C - 1, 2)])
def test_span_equals_per_token_lookup(directory, start, n):
    pos = np.arange(start, start + n)
    want = directory.host_pages(np.full(n, 2), pos // PS)
    got = directory.host_pages_span(2, start, n, PS)
    assert got.shape == (n, HKV) and got.dtype == np.int64
    np.testing.assert_array_equal(got, want)
    assert got.max() <= SCRATCH


def test_step_host_pages_equals_per_token_lookup(directory):
    """A step of two decode rows then prefill chunks of 17 and 54 tokens (off page edges):
    ``step_host_pages`` == the per-token lookup over the step's positions and rows."""
    from sparseserve.engine.sched_output import ScheduledChunk
    from sparseserve.worker.step_arrays import step_token_arrays

    def chunk(row, start, n, decode):
        return ScheduledChunk(request_id=f"r{row}", row=row, token_ids=[5] * n, start=start,
                              layer_start=0, layer_end=2, sample=decode, num_output_tokens=0)

    chunks = [chunk(0, 700, 1, True), chunk(3, 95, 1, True), chunk(1, 5, 17, False),
              chunk(2, 31, 54, False)]
    assert [c.is_decode for c in chunks] == [True, True, False, False]
    _, pos, rows, _ = step_token_arrays(chunks)
    np.testing.assert_array_equal(directory.step_host_pages(chunks, pos, rows, PS),
                                  directory.host_pages(rows, pos // PS))
