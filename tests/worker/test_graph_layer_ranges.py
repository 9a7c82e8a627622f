"""The layer ranges of a piecewise decode-step capture (cuda_graphs.layer_ranges): they tile
[0, num_layers) in order, non-empty, as many as asked (at most one per layer), sizes within
one of each other."""
import pytest

from sparseserve.worker.cuda_graphs import layer_ranges


@pytest.mark.parametrize("L, n", [(32, 4), (32, 1), (3, 2), (3, 8), (30, 7), (1, 1), (17, 5)])
def test_layer_ranges_tile_the_layers(L, n):
    r = layer_ranges(L, n)
    assert len(r) == min(n, L)
    assert r[0][0] == 0 and r[-1][1] == L
    assert all(a < b for a, b in r)
    assert all(b == c for (_, b), (c, _) in zip(r, r[1:]))
    sizes = [b - a for a, b in r]
    assert max(sizes) - min(sizes) <= 1
