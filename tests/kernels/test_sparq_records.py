"""keycode2-sparq's record layout (``kernels/sparq_records.py``, the default) against its first
layout (``records = False``): the records hold the same numbers (round trip through
``record_views``, bf16 / fp16 / fp32, page 16 / 32 / 64), and every kernel reading them —
the channel choice with its width cache written into the records, the generic score kernel,
the fused select's score phase (``sparq_tiles``, whole-record loads where a record is 4 words,
strided views otherwise; and the first version ``sparq_codes``) — gives exactly what it gives
on the first layout, itself checked against the torch reference in test_sparq_codes.py: the
same scores bit for bit and the same pages, at 1, 17, 54, 97 and 4097 pages in mixed batches,
GQA and MHA, fused and split launches. On DEVICE (compiled on CUDA, interpreted on CPU)."""
import pytest
import torch

from sparseserve.kernels import ref
from sparseserve.kernels.page_select import select_pages
from sparseserve.kernels.sparq_codes import sparq_channels, sparq_page_bounds
from sparseserve.kernels.sparq_records import pack_records, record_views, record_words
from sparseserve.sparse import get_algorithm_class
from sparseserve.sparse.base import LayerSummaries

from tests.conftest import DEVICE
from tests.kernels import to_dev

LOG2E = 1.4426950408889634


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ps", [16, 32, 64])
def test_records_round_trip(dtype, ps):
    gen = torch.Generator().manual_seed(ps)
    n, d = 5, 24
    lo, hi = torch.randn(n, d, generator=gen).to(dtype), torch.randn(n, d, generator=gen).to(dtype)
    codes = torch.randint(-2**31, 2**31 - 1, (n, d, ps // 16), generator=gen, dtype=torch.int32)
    nr = record_words(dtype.itemsize, ps)
    assert nr & (nr - 1) == 0 and nr >= (2 if dtype == torch.float32 else 1) + ps // 16 + 1
    v = record_views(pack_records(lo, hi, codes, nr), dtype, d, ps)
    assert torch.equal(v["kmin"], lo) and torch.equal(v["kmax"], hi)
    assert torch.equal(v["codes"], codes) and (v["wsum"] == -1).all()
    assert (dtype, ps, nr) not in ((torch.bfloat16, 32, 4),) or v["kmin"].stride(1) == 8


def _pair(npages, Hq, Hkv, D, ps, dtype, seed):
    """Both layouts of the same indexed pages, on DEVICE: (algorithm, LayerSummaries) per
    layout, queries, a page table with rows of ``npages`` pages (the last KV head's one
    shorter; distinct pages, masked past num_pages) and the reference's channel choice."""
    gen = torch.Generator().manual_seed(seed)
    B, W = len(npages), max(npages)
    P = B * Hkv * W
    k = (torch.randn(P, ps, D, generator=gen) * (0.2 + 3 * torch.rand(P, 1, D, generator=gen))
         + torch.randn(P, 1, D, generator=gen)).to(dtype)
    out = []
    for records in (True, False):
        alg = get_algorithm_class("keycode2-sparq")(ps, 8, 1, 2)
        alg.records = records
        summ = alg.make_summaries(P + 1, D, dtype)
        alg.index(k, torch.arange(P, dtype=torch.int32), torch.full((P,), ps, dtype=torch.int32),
                  summ, None)
        out.append((alg, LayerSummaries({n: to_dev(t) for n, t in summ.tensors.items()},
                                        summ.shapes)))
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    table = torch.randperm(P, generator=gen).view(B, Hkv, W).to(torch.int32)
    num = torch.tensor(npages, dtype=torch.int32).view(B, 1).repeat(1, Hkv)
    num[:, -1] = (num[:, -1] - 1).clamp(min=1)
    table = torch.where(torch.arange(W).view(1, 1, W) < num.unsqueeze(-1), table, 0)
    q, table, num = to_dev(q, table, num)
    v = out[1][0].views(out[1][1])
    chosen = ref.sparq_channels(q, v["kmin"], v["kmax"], table, num, 16)
    return out, q, table, num, chosen


@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_channel_choice_and_width_cache_in_records(Hq, Hkv):
    """The channel kernel on record views == on the first layout: the same channels, and the
    width sums it caches land in the records' width words (equal to the first layout's)."""
    (new, old), q, table, num, chosen = _pair([1, 2, 17, 54, 97], Hq, Hkv, 64, 32,
                                              torch.bfloat16, Hq)
    vn, vo = new[0].views(new[1]), old[0].views(old[1])
    got_n = sparq_channels(q, vn["kmin"], vn["kmax"], vn["wsum"], table, num, 16)
    got_o = sparq_channels(q, vo["kmin"], vo["kmax"], vo["wsum"], table, num, 16)
    assert torch.equal(got_n, chosen) and torch.equal(got_o, chosen)
    assert torch.equal(vn["wsum"], vo["wsum"]) and (vn["wsum"][:-1] >= 0).any()
    # the records' other words are untouched by the width writes
    assert torch.equal(vn["kmin"], vo["kmin"]) and torch.equal(vn["codes"], vo["codes"])
    again = sparq_channels(q, vn["kmin"], vn["kmax"], vn["wsum"], table, num, 16)
    assert torch.equal(again, chosen)  # read back from the records


_LAYOUTS = {"bf16-p32": (torch.bfloat16, 32), "bf16-p16": (torch.bfloat16, 16),
            "f32-p16": (torch.float32, 16), "f32-p32-strided": (torch.float32, 32),
            "bf16-p64-strided": (torch.bfloat16, 64), "f16-p32": (torch.float16, 32)}
# every dtype / page size with GQA; MHA (twice the interpreter time per case) on one case of
# each record shape (whole-record p32, strided, p16) - the head mapping is layout-independent
_CASES = [("gqa", n) for n in _LAYOUTS] + [("mha", n) for n in
                                          ("bf16-p32", "f32-p32-strided", "f32-p16")]


@pytest.mark.parametrize("Hq,Hkv,dtype,ps", [
    pytest.param(*{"gqa": (8, 2), "mha": (4, 4)}[h], *_LAYOUTS[n], id=f"{h}-{n}")
    for h, n in _CASES])
def test_scores_and_selection_equal_the_first_layout(Hq, Hkv, dtype, ps):
    """Per-head scores (the generic kernel; the fused select's score phase through
    ``scores_out``, both versions, fused and split) and the selected pages are bit-identical
    on the records and on the first layout."""
    (new, old), q, table, num, ch = _pair([1, 17, 54, 97], Hq, Hkv, 64, ps, dtype,
                                          ps + Hq + dtype.itemsize)
    vn, vo = new[0].views(new[1]), old[0].views(old[1])
    args = lambda v: (q, v["kmean"], v["kscale"], v["kmin"], v["kmax"], v["codes"], ch,  # noqa
                      table, num)
    assert torch.equal(ref.sparq_page_bounds(*args(vn)), ref.sparq_page_bounds(*args(vo)))
    assert torch.equal(sparq_page_bounds(*args(vn)), sparq_page_bounds(*args(vo)))
    B, _, W = table.shape
    tiles = None  # sparq_tiles' fused scores
    for kernel, splits in ((1, 1), (2, 3), (2, 1)):
        got = []
        for v in (vn, vo):
            xs = torch.full((B, Hkv, Hq // Hkv, W), float("nan"), device=DEVICE)
            sel = select_pages(q, v["kmin"], v["kmax"], table, num, None, 8, 1, 2,
                               num_splits=splits, codes=v["codes"], bits=2, kmean=v["kmean"],
                               kscale=v["kscale"], sparq_chan=ch, sparq_kernel=kernel,
                               sparq_rec=v["rec"], scores_out=xs)
            got.append((xs.nan_to_num(), sel))
        assert torch.equal(got[0][0], got[1][0]), (kernel, splits)
        for a, b in zip(got[0][1], got[1][1]):
            assert torch.equal(a, b)
        tiles = got[0][0]
    if vn["rec"].shape[1] == 4 * 64:  # whole-record loads: kmin / kmax give the dtype only
        xs = torch.full((B, Hkv, Hq // Hkv, W), float("nan"), device=DEVICE)
        zero = torch.zeros_like(vn["kmin"])
        select_pages(q, zero, zero, table, num, None, 8, 1, 2, codes=vn["codes"], bits=2,
                     kmean=vn["kmean"], kscale=vn["kscale"], sparq_chan=ch, sparq_kernel=2,
                     sparq_rec=vn["rec"], scores_out=xs)
        assert torch.equal(xs.nan_to_num(), tiles)
    want = ref.sparq_page_bounds(*args(vo)) * (64 ** -0.5 * LOG2E)
    full = torch.arange(W, device=DEVICE).view(1, 1, 1, W) < (num - 1).view(B, Hkv, 1, 1)
    full = full.expand_as(want)
    torch.testing.assert_close(got[0][0][full], want[full], rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("splits", [1, 3])
def test_warps_per_program_do_not_change_scores_or_pages(splits):
    """sparq_tiles lays a sub-tile's pages over the program's warps (K = 16 / NW pages per
    warp): 8 warps (``keycode2-sparq@select_warps=8``, the occupancy variant) give the same
    scores bit for bit and the same pages as the default 4, fused and split."""
    (new, _), q, table, num, ch = _pair([1, 17, 54, 97], 8, 2, 64, 32, torch.bfloat16, 5)
    v = new[0].views(new[1])
    B, Hkv, W = table.shape
    got = []
    for warps in (None, 8):
        xs = torch.full((B, Hkv, 4, W), float("nan"), device=DEVICE)
        sel = select_pages(q, v["kmin"], v["kmax"], table, num, None, 8, 1, 2, num_splits=splits,
                           num_warps=warps, codes=v["codes"], bits=2, kmean=v["kmean"],
                           kscale=v["kscale"], sparq_chan=ch, sparq_kernel=2,
                           sparq_rec=v["rec"], scores_out=xs)
        got.append((xs.nan_to_num(), sel))
    assert torch.equal(got[0][0], got[1][0])
    for a, b in zip(got[0][1], got[1][1]):
        assert torch.equal(a, b)


def test_wide_row_and_the_algorithm_select():
    """4097 pages in a row next to a 5-page one: the algorithm's fused select (channel choice
    + select_pages, Triton) and its generic select over ``score`` pick the same pages in both
    layouts."""
    (new, old), q, table, num, _ = _pair([4097, 5], 8, 2, 64, 32, torch.bfloat16, 7)
    last = to_dev(torch.full((2,), 3, dtype=torch.int32))
    sels = [alg.select_kernel(q, table, num, last, summ, backend="triton")
            for alg, summ in (new, old)]
    for alg, _ in (new, old):
        alg.fused_select = False
    plain = [alg.select(q, table, num, last, summ, None) for alg, summ in (new, old)]
    for a, b in zip(sels[0], sels[1]):  # pages, num_sel, blocks
        assert torch.equal(a, b)
    assert torch.equal(plain[0].page_table, plain[1].page_table)
    for b in range(2):
        for h in range(2):
            m = int(plain[0].num_pages[b, h])
            assert int(sels[0][1][b, h]) == m
            assert set(sels[0][2][b, h, :m].tolist()) == set(plain[0].blocks[b, h, :m].tolist())
