"""``select_pages(..., sparq_kernel=4)`` (``keycode2-sparq@score_kernel=4``): sparq_stream's
score loop in split programs of ``page_select.LEAN_WARPS`` warps. Against the stream at its 4
warps (``sparq_kernel=3``) and the torch reference: the same per-head scores to fp32 rounding,
the same pages, on both summary layouts (their scores bit for bit interpreted, within a bf16
rounding step compiled: ``assert_same_across_layouts``); rows of 1, 17, 97 and 4097 pages in mixed
batches, split (the 2-warp launch) and fused, GQA and MHA, every record kind. On DEVICE
(compiled on CUDA, interpreted on CPU)."""
import importlib
import os

import pytest
import torch

from sparseserve.kernels.page_select import LEAN_WARPS
from sparseserve.sparse import get_algorithm_class

from tests.kernels import to_dev
from tests.kernels.test_sparq_records import _LAYOUTS, _pair
from tests.kernels.test_sparq_stream import (_select, assert_matches_reference,
                                             check_layouts_and_baseline)

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks")


@pytest.mark.parametrize("Hq,Hkv,layout", [(8, 2, n) for n in
                                           ("bf16-p32", "f16-p32", "bf16-p16",
                                            "f32-p32-strided", "f32-p16",
                                            "bf16-p64-strided")] + [(4, 4, "bf16-p32")])
def test_kernel4_equals_stream_and_reference(Hq, Hkv, layout):
    assert LEAN_WARPS < 4  # else this version is the stream's own launch
    dtype, ps = _LAYOUTS[layout]
    (new, old), q, table, num, ch = _pair([1, 17, 97], Hq, Hkv, 64, ps, dtype,
                                          ps + Hq + dtype.itemsize)
    vn, vo = new[0].views(new[1]), old[0].views(old[1])
    for splits in (3, 1):  # split (the LEAN_WARPS launch) and fused
        stream = _select(vn, q, table, num, ch, 3, splits)
        got = [_select(v, q, table, num, ch, 4, splits) for v in (vn, vo)]
        x, full = check_layouts_and_baseline(got, stream, num, splits)
    assert_matches_reference(x, full, q, vo, ch, table, num)


def test_kernel4_wide_row():
    """A 4097-page row beside a 5-page one, split by the heuristic (CPU: 8 stand-in SMs) and
    into 3 programs: the stream's scores to fp32 rounding and its pages."""
    (new, _), q, table, num, ch = _pair([4097, 5], 8, 2, 64, 32, torch.bfloat16, 11)
    v = new[0].views(new[1])
    for splits in (None, 3):
        stream = _select(v, q, table, num, ch, 3, splits)
        got = _select(v, q, table, num, ch, 4, splits)
        for a, c in zip(got[1], stream[1]):
            assert torch.equal(a, c), splits
        torch.testing.assert_close(got[0].nan_to_num(), stream[0].nan_to_num(), rtol=1e-5,
                                   atol=1e-5)


def test_algorithm_knob_selects_kernel4(monkeypatch):
    """``keycode2-sparq@score_kernel=4`` as ``benchmarks/sparse_decode.py`` applies it (the
    variant's key=value set as a class attribute) picks this launch: the stream's pages."""
    (new, _), q, table, num, _ = _pair([97, 54], 8, 2, 64, 32, torch.bfloat16, 3)
    alg, summ = new
    last = to_dev(torch.full((2,), 5, dtype=torch.int32))
    alg.score_kernel = 3
    stream = alg.select_kernel(q, table, num, last, summ, backend="triton")
    # the benchmark's own parser, imported here (not at collection: every xdist worker
    # imports each test module, and this one should not put benchmarks/ on their paths)
    monkeypatch.syspath_prepend(BENCHMARKS)
    parse_variant = importlib.import_module("sparse_decode_measure").parse_variant
    base, variant = parse_variant("keycode2-sparq@score_kernel=4")
    assert isinstance(alg, get_algorithm_class(base)) and variant == {"score_kernel": 4}
    for key, val in variant.items():
        assert hasattr(alg, key)
        setattr(alg, key, val)
    assert alg.score_kernel == 4
    got = alg.select_kernel(q, table, num, last, summ, backend="triton")
    for a, b in zip(got, stream):
        assert torch.equal(a, b)


def test_unknown_score_phase_and_overridden_warps_are_reported():
    """A sparq_kernel that names no score phase is an error that lists the versions; an
    explicit num_warps with kernel 4 (which would run it as kernel 3 at that width) warns."""
    (new, _), q, table, num, ch = _pair([17, 5], 8, 2, 64, 32, torch.bfloat16, 3)
    v = new[0].views(new[1])
    with pytest.raises(ValueError, match="sparq_kernel=7.*4 \\(sparq_stream in"):
        _select(v, q, table, num, ch, 7)
    with pytest.warns(UserWarning, match="num_warps=4 .* replaces sparq_kernel=4"):
        _select(v, q, table, num, ch, 4, splits=2, warps=4)
