"""The SparQ-style key-code kernels (``sparq_codes``, compiled on CUDA, interpreted on CPU)
against their torch references (``ref.sparq_channels``, ``ref.sparq_page_bounds``,
``ref.select_pages(..., sparq_chan=)``) on DEVICE, and the reference against an explicit
decode of the approximate keys (``KeyCodeSparQ.approx_keys``): 1, 17, 54, 97 and 4097 pages,
GQA and MHA, page 16 / 32, fp32 / bf16 summaries; the channel choice's width-sum cache (first
call, the step after a page filled, a torn row, no cache)."""
import pytest
import torch

from sparseserve.kernels import ref, sparq_page_bounds as dispatch, sparq_supported
from sparseserve.kernels.sparq_codes import sparq_channels, sparq_page_bounds
from sparseserve.sparse import get_algorithm_class

from tests.conftest import DEVICE
from tests.kernels import close, to_dev

NAMES = ("kmean", "kscale", "kmin", "kmax", "codes")


def _case(npages, Hq, Hkv, D, ps, gen, dtype=torch.float32, R=16):
    """Indexed pages of B = len(npages) rows (distinct pages) as the summaries' views
    (``KeyCodeSparQ.views``: the record layout's, strided; ``_case.layer``: the summaries),
    queries, table, num_pages (the last KV head's rows one page shorter), the reference's
    channel choice."""
    B, W = len(npages), max(npages)
    P = B * Hkv * W
    alg = get_algorithm_class("keycode2-sparq")(ps, 8, 1, 2)
    # channels of different spread and offset, so the chosen ones differ from row to row
    k = torch.randn(P, ps, D, generator=gen) * (0.2 + 3 * torch.rand(P, 1, D, generator=gen)) \
        + torch.randn(P, 1, D, generator=gen)
    summ = alg.make_summaries(P + 1, D, dtype)
    alg.index(k, torch.arange(P, dtype=torch.int32), torch.full((P,), ps, dtype=torch.int32),
              summ, None)
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    table = torch.randperm(P, generator=gen).view(B, Hkv, W).to(torch.int32)
    num = torch.tensor(npages, dtype=torch.int32).view(B, 1).repeat(1, Hkv)
    num[:, -1] = (num[:, -1] - 1).clamp(min=1)  # vary rows
    _case.full = table  # unmasked (every entry a page), for tests that lengthen the rows
    table = torch.where(torch.arange(W).view(1, 1, W) < num.unsqueeze(-1), table, 99999)
    _case.layer, summ = summ, alg.views(summ)
    chosen = ref.sparq_channels(q, summ["kmin"], summ["kmax"], table, num, R)
    return alg, summ, q, table, num, chosen


def _explicit(alg, summ, q, table, num, chosen):
    """logsumexp over each page's tokens of q . mean + q[R] . (k^ - mean)[R], in float64."""
    B, Hq, D = q.shape
    _, Hkv, W = table.shape
    ok = torch.arange(W).view(1, 1, W) < num.unsqueeze(-1)
    rows = torch.where(ok, table.long(), 0)
    mean = alg.page_mean(summ, rows).double()                          # [B, Hkv, W, D]
    kh = alg.approx_keys(summ, rows).double()                          # [B, Hkv, W, ps, D]
    qg = q.double().view(B, Hkv, Hq // Hkv, D)
    idx = chosen.long().unsqueeze(2).expand(-1, -1, qg.shape[2], -1)    # [B, Hkv, G, R]
    qm = torch.zeros_like(qg).scatter_(-1, idx, qg.gather(-1, idx))      # q on the R channels
    x = (torch.einsum("bhgd,bhwd->bhgw", qg, mean).unsqueeze(-1)
         + torch.einsum("bhgd,bhwtd->bhgwt", qm, kh - mean.unsqueeze(-2))) * D ** -0.5
    return torch.logsumexp(x, -1) / D ** -0.5


@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 64), (4, 4, 128), (9, 3, 64)],
                         ids=["gqa3", "mha", "gqa3-h3"])
@pytest.mark.parametrize("ps", [16, 32])
def test_sparq_page_bounds_match_reference(Hq, Hkv, D, ps):
    gen = torch.Generator().manual_seed(Hq * 11 + D + ps)
    alg, summ, q, table, num, ch = _case([1, 17, 54, 97], Hq, Hkv, D, ps, gen)
    s = [summ[n] for n in NAMES]
    assert sparq_supported(16, D, s[-1].shape[1])
    want = ref.sparq_page_bounds(*to_dev(q, *s, ch, table, num))
    got = sparq_page_bounds(*to_dev(q, *s, ch, table, num))
    assert got.device.type == DEVICE.type
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and (got[~fin] == float("-inf")).all()
    close(got[fin], want[fin], rtol=1e-4, atol=1e-3)
    explicit = _explicit(alg, _case.layer, q, table, num, ch)
    torch.testing.assert_close(want.cpu()[fin.cpu()].double(), explicit[fin.cpu()],
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(dispatch(q, *s, ch, table, num, backend="torch"),
                       ref.sparq_page_bounds(q, *s, ch, table, num))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparq_page_bounds_wide_row_and_half_summaries(dtype):
    """4097 pages in a row (fp32); bf16 summaries (on CUDA the dots run in bf16)."""
    gen = torch.Generator().manual_seed(5)
    npages = [4097, 5] if dtype == torch.float32 else [300, 97]
    _, summ, q, table, num, ch = _case(npages, 8, 2, 64, 32, gen, dtype)
    s = [summ[n] for n in NAMES]
    want = ref.sparq_page_bounds(*to_dev(q, *s, ch, table, num))
    got = sparq_page_bounds(*to_dev(q, *s, ch, table, num))
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    if dtype == torch.float32:
        close(got[fin], want[fin], rtol=1e-4, atol=1e-3)
    else:  # decoded deviations, means and queries rounded to bf16 for the dots
        close(got[fin], want[fin], dtype, rtol=2e-2, atol=5e-2)


def _width_sums(summ, table, num):
    """[B, Hkv, D] float64: kmax - kmin summed over each row's pages before its last."""
    W = table.shape[-1]
    ok = torch.arange(W).view(1, 1, W) < num.long().unsqueeze(-1) - 1
    rows = torch.where(ok, table.long(), 0)
    wid = summ["kmax"][rows].double() - summ["kmin"][rows].double()
    return torch.where(ok.unsqueeze(-1), wid, 0.0).sum(2)


@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 64), (3, 3, 16)], ids=["gqa", "mha-d16"])
def test_sparq_channels_and_their_width_cache(Hq, Hkv, D):
    """The kernel's channels == the reference's: on the first call (every row's width sum
    computed over its pages, then cached at page n - 2), on a second (read back), after each
    row gained a page (the cached sum at n - 3 plus page n - 2's width), with a torn cache
    row (one channel still -1: recomputed), and without the cache (wsum untouched)."""
    gen = torch.Generator().manual_seed(D + Hq)
    R = min(16, D)
    npages = [1, 2, 3, 17, 54, 97]
    _, summ, q, table, num, want = _case(npages, Hq, Hkv, D, 32, gen, R=R)
    ws = to_dev(summ["wsum"].clone())
    assert (ws[:-1] == -1).all()  # index() marks every page's sum unknown (the last: scratch)
    args = to_dev(q, summ["kmin"], summ["kmax"])
    got = sparq_channels(*args, ws, *to_dev(table, num), R)
    assert torch.equal(got.cpu(), want)
    sums = _width_sums(summ, table, num)
    for b in range(table.shape[0]):
        for h in range(Hkv):
            n = int(num[b, h])
            if n >= 2:  # the row's sum, at its page n - 2
                close(ws[int(table[b, h, n - 2])].cpu().double(), sums[b, h], rtol=1e-5, atol=1e-4)
    assert torch.equal(sparq_channels(*args, ws, *to_dev(table, num), R).cpu(), want)
    # every row one page longer (but the one as wide as the table): its page n - 1 (indexed,
    # sum unknown) becomes n - 2
    W = table.shape[-1]
    num2 = (num + 1).clamp(max=W)
    longer = torch.where(torch.arange(W).view(1, 1, W) < num2.unsqueeze(-1), _case.full, 99999)
    want2 = ref.sparq_channels(q, summ["kmin"], summ["kmax"], longer, num2, R)
    got2 = sparq_channels(*args, ws, *to_dev(longer, num2), R)
    assert torch.equal(got2.cpu(), want2)
    sums2 = _width_sums(summ, longer, num2)
    b, h = 4, 0  # a row of 54 -> 55 pages: the incremental path
    close(ws[int(longer[b, h, int(num2[b, h]) - 2])].cpu().double(), sums2[b, h], rtol=1e-5,
          atol=1e-4)
    # a torn row: one channel not written yet -> invalid, recomputed
    page = int(longer[b, h, int(num2[b, h]) - 2])
    ws[page, 3] = -1.0
    ws[int(longer[b, h, int(num2[b, h]) - 3]), 0] = -1.0
    assert torch.equal(sparq_channels(*args, ws, *to_dev(longer, num2), R).cpu(), want2)
    close(ws[page].cpu().double(), sums2[b, h], rtol=1e-5, atol=1e-4)
    # no cache: the same channels, wsum untouched
    blank = to_dev(summ["wsum"].clone())
    got3 = sparq_channels(*args, blank, *to_dev(longer, num2), R, use_cache=False)
    assert torch.equal(got3.cpu(), want2) and torch.equal(blank, to_dev(summ["wsum"]))


@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 64), (4, 4, 128)], ids=["gqa", "mha"])
def test_fused_select_with_sparq_matches_reference(Hq, Hkv, D):
    """The fused select (``page_select.select_pages`` with ``sparq_chan=``): the kernel's
    pages are the reference's (ref.select_pages = mass_from_bounds(sparq_page_bounds) +
    top-k) at 1, 17, 54, 97 pages, fused and split launches; KeyCodeSparQ.select (fused) ==
    the generic select over its score."""
    from sparseserve.kernels.page_select import select_pages
    from sparseserve.sparse.base import LayerSummaries
    gen = torch.Generator().manual_seed(D + Hq)
    alg, summ, q, table, num, ch = _case([1, 17, 54, 97], Hq, Hkv, D, 32, gen)
    table = torch.where(table >= summ["kmean"].shape[0] - 1, 0, table)  # stay in range
    cc = dict(codes=to_dev(summ["codes"]), bits=2, kmean=to_dev(summ["kmean"]),
              kscale=to_dev(summ["kscale"]), sparq_chan=to_dev(ch))
    B = table.shape[0]
    box = to_dev(q, summ["kmin"], summ["kmax"], table, num)
    for budget, sink, local, splits in ((8, 1, 2, 1), (16, 0, 1, 3)):
        got = select_pages(*box, None, budget, sink, local, num_splits=splits, **cc)
        rp, rn, rb = ref.select_pages(*box, None, budget, sink, local, **cc)
        assert torch.equal(got[1].cpu(), rn.cpu())
        for b in range(B):
            for h in range(Hkv):
                m = int(rn[b, h])
                assert set(got[2][b, h, :m].tolist()) == set(rb[b, h, :m].tolist())
    last = torch.full((B,), 3, dtype=torch.int32)
    layer = _case.layer
    dev = LayerSummaries({n: t.to(DEVICE) for n, t in layer.tensors.items()}, layer.shapes)
    fused = alg.select(*to_dev(q, table, num, last), dev, None)
    alg.fused_select = False
    plain = alg.select(*to_dev(q, table, num, last), dev, None)
    assert torch.equal(fused.num_pages, plain.num_pages)
    for b in range(B):
        for h in range(Hkv):
            m = int(plain.num_pages[b, h])
            assert set(fused.blocks[b, h, :m].tolist()) == set(plain.blocks[b, h, :m].tolist())


@pytest.mark.parametrize("ps", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [2, 1])
def test_fused_select_scores_match_reference(kernel, dtype, ps):
    """The score phase of the fused select (``sparq_tiles`` = 2; the default ``sparq_stream``
    = 3 has its own tests in test_sparq_stream.py; and the first
    version ``sparq_codes.sparq_page_x`` = 1), through ``scores_out``: every full page's
    per-head score == ``ref.sparq_page_bounds`` in log2 units, split and fused launches, page
    16 / 32 / 64 (1, 2, 4 code words a channel), fp32 and bf16 summaries (on CUDA, bf16 at
    page 32 runs the bf16x2 decode of ``sparq_tiles``; GQA 4, as Llama-3-8B)."""
    from sparseserve.kernels.page_select import select_pages
    gen = torch.Generator().manual_seed(ps + kernel)
    Hq, Hkv, D = 8, 2, 64
    _, summ, q, table, num, ch = _case([1, 17, 54, 97, 130], Hq, Hkv, D, ps, gen, dtype)
    table = torch.where(table >= summ["kmean"].shape[0] - 1, 0, table)
    want = ref.sparq_page_bounds(q, summ["kmean"], summ["kscale"], summ["kmin"], summ["kmax"],
                                 summ["codes"], ch, table, num) * (D ** -0.5 * 1.4426950408889634)
    B, _, W = table.shape
    full = torch.arange(W).view(1, 1, 1, W) < (num - 1).view(B, Hkv, 1, 1)
    full = full.expand(B, Hkv, Hq // Hkv, W)
    cc = dict(codes=to_dev(summ["codes"]), bits=2, kmean=to_dev(summ["kmean"]),
              kscale=to_dev(summ["kscale"]), sparq_chan=to_dev(ch), sparq_kernel=kernel)
    box = to_dev(q, summ["kmin"], summ["kmax"], table, num)
    for splits in (1, 3):
        xs = torch.full((B, Hkv, Hq // Hkv, W), float("nan"), device=DEVICE)
        select_pages(*box, None, 8, 1, 2, num_splits=splits, scores_out=xs, **cc)
        got = xs.cpu()[full]
        assert torch.isfinite(got).all()
        if dtype == torch.float32:
            close(got, want[full], rtol=1e-4, atol=1e-3)
        else:  # decoded deviations, means and queries rounded to bf16 for the dots
            close(got, want[full], dtype, rtol=2e-2, atol=5e-2)
