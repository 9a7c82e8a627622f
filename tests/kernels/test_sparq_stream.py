"""keycode2-sparq's streaming score phase (``kernels/sparq_stream.py``, ``sparq_kernel=3``)
against ``sparq_tiles`` (``sparq_kernel=2``) and the torch reference: the same per-head scores
up to the page-term dot's summation order, the same pages, the same numbers on both summary
layouts (bit for bit), fused and split launches, the default warps and 8, rows of 1, 17, 54,
97 and 4097 pages in mixed batches, GQA and MHA, every record kind (bf16, fp16, fp32 boxes;
whole-record and strided loads). On DEVICE (compiled on CUDA, interpreted on CPU)."""
import pytest
import torch

from sparseserve.kernels import ref
from sparseserve.kernels.page_select import select_pages

from tests.conftest import DEVICE
from tests.kernels import to_dev
from tests.kernels.test_sparq_records import _LAYOUTS, _pair

LOG2E = 1.4426950408889634


def score_tol() -> dict:
    """Tolerance between two score kernels on the same summaries: fp32 summation order
    interpreted; compiled, also the bf16 rounding step of assert_same_across_layouts."""
    return dict(rtol=1e-5, atol=1e-5) if DEVICE.type == "cpu" else dict(rtol=2e-3, atol=2e-3)


def assert_same_across_layouts(a: torch.Tensor, b: torch.Tensor, msg) -> None:
    """Scores [B, Hkv, G, W] of one launch on the two summary layouts (NaN: never written).
    Interpreted, bit for bit. Compiled, within a bf16 rounding of the page-term operands: the
    two layouts compile to different kernels whose FMA contraction of ``lo + (hi - lo) / 8 -
    mean`` can differ by an fp32 ulp, and that value is rounded to bf16 for the dot, so a value
    on a rounding boundary moves one bf16 step (the H100, 16-token pages: 4 of 3,104 scores,
    at most 3.7e-4 relative; gpu-tests.md, twenty-fourth session)."""
    a, b = a.nan_to_num(), b.nan_to_num()
    if a.device.type == "cpu":
        assert torch.equal(a, b), msg
    else:
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=lambda m: f"{msg}: {m}")


def _select(v, q, table, num, ch, kernel, splits=None, warps=None):
    B, Hkv, W = table.shape
    xs = torch.full((B, Hkv, q.shape[1] // Hkv, W), float("nan"), device=DEVICE)
    sel = select_pages(q, v["kmin"], v["kmax"], table, num, None, 8, 1, 2, num_splits=splits,
                       num_warps=warps, codes=v["codes"], bits=2, kmean=v["kmean"],
                       kscale=v["kscale"], sparq_chan=ch, sparq_kernel=kernel,
                       sparq_rec=v["rec"], scores_out=xs)
    return xs, sel


def assert_matches_reference(x, full, q, v, ch, table, num) -> None:
    """Scores x of the full pages against the torch reference on summaries v (first layout's
    views), in the kernels' log2 units (head_dim 64)."""
    want = ref.sparq_page_bounds(q, v["kmean"], v["kscale"], v["kmin"], v["kmax"], v["codes"],
                                 ch, table, num) * (64 ** -0.5 * LOG2E)
    torch.testing.assert_close(x[full], want[full], rtol=2e-2, atol=5e-2)


def check_layouts_and_baseline(got, base, num, splits):
    """got: one score kernel's (scores, selection) on both summary layouts; base: another
    kernel's on the first. The layouts agree (scores as assert_same_across_layouts, pages
    exactly); only full pages are written (NaN elsewhere); scores match the baseline to
    score_tol and its pages exactly. -> (scores, mask of full pages)."""
    assert_same_across_layouts(got[0][0], got[1][0], splits)
    for a, b in zip(got[0][1], got[1][1]):
        assert torch.equal(a, b)
    x, sel = got[0]
    B, Hkv, _, W = x.shape
    full = torch.arange(W, device=x.device).view(1, 1, 1, W) < (num - 1).view(B, Hkv, 1, 1)
    full = full.expand_as(x)
    assert x[~full].isnan().all() and not x[full].isnan().any()  # only full pages written
    torch.testing.assert_close(x[full], base[0][full], **score_tol())
    for a, b in zip(sel, base[1]):  # pages, num_sel, blocks
        assert torch.equal(a, b), splits
    return x, full


@pytest.mark.parametrize("Hq,Hkv,layout", [(8, 2, n) for n in
                                           ("bf16-p32", "f16-p32", "bf16-p16",
                                            "f32-p32-strided", "f32-p16",
                                            "bf16-p64-strided")] + [(4, 4, "bf16-p32")])
def test_stream_equals_tiles_and_reference(Hq, Hkv, layout):
    dtype, ps = _LAYOUTS[layout]
    (new, old), q, table, num, ch = _pair([1, 17, 54, 97], Hq, Hkv, 64, ps, dtype,
                                          ps + Hq + dtype.itemsize)
    vn, vo = new[0].views(new[1]), old[0].views(old[1])
    tiles = _select(vn, q, table, num, ch, 2)
    for splits in (1, 5):
        got = [_select(v, q, table, num, ch, 3, splits) for v in (vn, vo)]
        x, full = check_layouts_and_baseline(got, tiles, num, splits)
    assert_matches_reference(x, full, q, vo, ch, table, num)


def test_stream_wide_row_and_warps():
    """A 4097-page row beside a 5-page one: the stream fused (one program per row, 16 warps at
    this width), split with the default 4 warps and split with 8 — the same scores bit for
    bit and the same pages as sparq_tiles (split)."""
    (new, _), q, table, num, ch = _pair([4097, 5], 8, 2, 64, 32, torch.bfloat16, 11)
    v = new[0].views(new[1])
    tiles = _select(v, q, table, num, ch, 2, 3)
    got = [_select(v, q, table, num, ch, 3, splits, warps)
           for splits, warps in ((3, None), (1, None), (3, 8))]
    for other in got[1:]:
        assert torch.equal(got[0][0].nan_to_num(), other[0].nan_to_num())
    for g in got:
        for a, c in zip(g[1], tiles[1]):
            assert torch.equal(a, c)
    torch.testing.assert_close(got[0][0].nan_to_num(), tiles[0].nan_to_num(), rtol=1e-5,
                               atol=1e-5)


def test_algorithm_knob_selects_the_stream_kernel():
    """``keycode2-sparq@score_kernel=N`` (a class attribute) picks the score phase of the
    algorithm's fused select: the stream (3) and the tiles (2) choose the same
    pages on the same summaries."""
    (new, _), q, table, num, _ = _pair([97, 54], 8, 2, 64, 32, torch.bfloat16, 3)
    alg, summ = new
    last = to_dev(torch.full((2,), 5, dtype=torch.int32))
    alg.score_kernel = 3  # the default interpreted (compiled: sparq_lanes, test_sparq_lanes)
    stream = alg.select_kernel(q, table, num, last, summ, backend="triton")
    alg.score_kernel = 2
    tiles = alg.select_kernel(q, table, num, last, summ, backend="triton")
    for a, b in zip(tiles, stream):
        assert torch.equal(a, b)
