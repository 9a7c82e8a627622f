"""Channel key-code page scores (``channel_codes.channel_code_page_bounds``, compiled on CUDA,
interpreted on CPU) against ``ref.channel_code_page_bounds`` on DEVICE, and the reference
against an explicit decode of the approximate keys (``KeyCodeChannels.approx_keys``), at 1,
17, 54, 97 and 4097 pages, GQA and MHA, fp32 / bf16 / fp16 summaries, the int8 mean."""
import pytest
import torch

from sparseserve.kernels import channel_code_page_bounds as dispatch
from sparseserve.kernels import ref
from sparseserve.kernels import channel_codes_supported as supported
from sparseserve.kernels.channel_codes import channel_code_page_bounds
from sparseserve.sparse.keycode_channels import KeyCodeChannels

from tests.conftest import DEVICE
from tests.kernels import close, to_dev


def _algo(divisor, int8_mean, ps):
    cls = type("KC", (KeyCodeChannels,), {"channel_divisor": divisor, "int8_mean": int8_mean,
                                          "name": "kc-test"})
    return cls(ps, 8, 1, 1)


def _case(npages, Hq, Hkv, D, ps, divisor, gen, dtype=torch.float32, int8_mean=False):
    B, W = len(npages), max(npages)
    P = B * Hkv * W
    alg = _algo(divisor, int8_mean, ps)
    # channels of different spread, so the widest ones differ from page to page
    k = torch.randn(P, ps, D, generator=gen) * (0.2 + 3 * torch.rand(P, 1, D, generator=gen))
    summ = alg.make_summaries(P + 1, D, dtype)
    alg.index(k, torch.arange(P, dtype=torch.int32), torch.full((P,), ps, dtype=torch.int32),
              summ, None)
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    table = torch.randperm(P, generator=gen)[:B * Hkv * W].view(B, Hkv, W).to(torch.int32)
    num = torch.tensor(npages, dtype=torch.int32).view(B, 1).repeat(1, Hkv)
    num[:, -1] = (num[:, -1] - 1).clamp(min=1)  # vary rows
    table = torch.where(torch.arange(W).view(1, 1, W) < num.unsqueeze(-1), table, 99999)
    names = ("kmean", "klo", "khi", "chan", "codes")
    return alg, summ, q, table, num, [summ[n] for n in names], (summ["kscale"] if int8_mean
                                                                  else None)


def _explicit(alg, summ, q, table, num):
    """logsumexp over each page's tokens of q . approx key, from approx_keys, in float64."""
    B, Hq, D = q.shape
    _, Hkv, W = table.shape
    ok = torch.arange(W).view(1, 1, W) < num.unsqueeze(-1)
    kh = alg.approx_keys(summ, torch.where(ok, table.long(), 0))  # [B, Hkv, W, ps, D]
    x = torch.einsum("bhgd,bhwtd->bhgwt", q.float().view(B, Hkv, Hq // Hkv, D), kh) * D ** -0.5
    return torch.logsumexp(x.double(), -1) / D ** -0.5


@pytest.mark.parametrize("int8_mean", [False, True])
@pytest.mark.parametrize("Hq,Hkv,D,divisor", [(6, 2, 64, 4), (4, 4, 128, 8), (9, 3, 64, 2),
                                              (8, 2, 128, 4)])
@pytest.mark.parametrize("ps", [16, 32])
def test_channel_code_scores_match_reference(int8_mean, Hq, Hkv, D, divisor, ps):
    gen = torch.Generator().manual_seed(Hq * 11 + D + ps + int8_mean)
    alg, summ, q, table, num, s, ks = _case([1, 17, 54, 97], Hq, Hkv, D, ps, divisor, gen,
                                            int8_mean=int8_mean)
    assert supported(s[1].shape[1], D)
    want = ref.channel_code_page_bounds(*to_dev(q, *s, table, num, ks))
    got = channel_code_page_bounds(*to_dev(q, *s, table, num, ks))
    assert got.device.type == DEVICE.type
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and (got[~fin] == float("-inf")).all()
    close(got[fin], want[fin], rtol=1e-4, atol=1e-3)
    explicit = _explicit(alg, summ, q, table, num)
    torch.testing.assert_close(want.cpu()[fin.cpu()].double(), explicit[fin.cpu()],
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(dispatch(q, *s, table, num, ks, backend="torch"),
                       ref.channel_code_page_bounds(q, *s, table, num, ks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_channel_code_scores_wide_row_and_half_summaries(dtype):
    """4097 pages in a row; 16-bit summaries (on CUDA the dots run in that dtype)."""
    gen = torch.Generator().manual_seed(5)
    npages = [4097, 5] if dtype == torch.float32 else [300, 97]
    _, _, q, table, num, s, ks = _case(npages, 8, 2, 64, 32, 4, gen, dtype)
    want = ref.channel_code_page_bounds(*to_dev(q, *s, table, num, ks))
    got = channel_code_page_bounds(*to_dev(q, *s, table, num, ks))
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    if dtype == torch.float32:
        close(got[fin], want[fin], rtol=1e-4, atol=1e-3)
    else:  # decoded deviations and gathered queries rounded to the summary dtype for the dot
        close(got[fin], want[fin], dtype, rtol=2e-2, atol=5e-2)


def test_small_channel_counts_run_the_reference():
    """R < 16 coded channels (small heads): the dispatcher runs the reference."""
    gen = torch.Generator().manual_seed(2)
    _, _, q, table, num, s, ks = _case([17, 3], 4, 2, 16, 32, 8, gen)
    assert s[1].shape[1] == 4 and not supported(4, 16)
    got = dispatch(*to_dev(q, *s, table, num, ks))
    want = ref.channel_code_page_bounds(*to_dev(q, *s, table, num, ks))
    assert torch.equal(got, want)


@pytest.mark.parametrize("int8_mean", [False, True])
@pytest.mark.parametrize("Hq,Hkv,D,divisor", [(6, 2, 64, 4), (4, 4, 128, 8)])
def test_fused_select_with_channel_codes_matches_reference(int8_mean, Hq, Hkv, D, divisor):
    """The fused select (``page_select.select_pages`` with ``kmean=``/``chan=``): the kernel's
    pages are the reference's (ref.select_pages = mass_from_bounds(channel_code_page_bounds)
    + top-k) at 1, 17, 54, 97 pages, fused and split launches; KeyCodeChannels.select ==
    the generic select over its score."""
    from sparseserve.kernels.page_select import select_pages
    from sparseserve.sparse.base import LayerSummaries
    gen = torch.Generator().manual_seed(D + divisor + int8_mean)
    alg, summ, q, table, num, s, ks = _case([1, 17, 54, 97], Hq, Hkv, D, 32, divisor, gen,
                                            int8_mean=int8_mean)
    table = torch.where(table >= summ["kmean"].shape[0] - 1, 0, table)  # stay in range
    kmean, klo, khi, chan, codes = s
    B = table.shape[0]
    cc = dict(codes=to_dev(codes), bits=2, kmean=to_dev(kmean), chan=to_dev(chan),
              kscale=to_dev(ks) if ks is not None else None)
    for budget, sink, local, splits in ((8, 1, 2, 1), (16, 0, 1, 3)):
        got = select_pages(*to_dev(q, klo, khi, table, num), None, budget, sink, local,
                           num_splits=splits, **cc)
        rp, rn, rb = ref.select_pages(*to_dev(q, klo, khi, table, num), None, budget, sink,
                                      local, **cc)
        assert torch.equal(got[1].cpu(), rn.cpu())
        for b in range(B):
            for h in range(Hkv):
                m = int(rn[b, h])
                assert set(got[2][b, h, :m].tolist()) == set(rb[b, h, :m].tolist())
    last = torch.full((B,), 3, dtype=torch.int32)
    dev = LayerSummaries({n: t.to(DEVICE) for n, t in summ.tensors.items()}, summ.shapes)
    fused = alg.select(*to_dev(q, table, num, last), dev, None)
    alg.fused_select = False
    plain = alg.select(*to_dev(q, table, num, last), dev, None)
    assert torch.equal(fused.num_pages, plain.num_pages)
    for b in range(B):
        for h in range(Hkv):
            m = int(plain.num_pages[b, h])
            assert set(fused.blocks[b, h, :m].tolist()) == set(plain.blocks[b, h, :m].tolist())


def test_fused_select_with_channel_codes_wide_row():
    """A 4097-page row next to a 5-page one, bf16 summaries, budget 64."""
    from sparseserve.kernels.page_select import select_pages
    gen = torch.Generator().manual_seed(11)
    _, summ, q, table, num, s, ks = _case([4097, 5], 8, 2, 64, 32, 4, gen, torch.bfloat16)
    table = torch.where(table >= summ["kmean"].shape[0] - 1, 0, table)
    kmean, klo, khi, chan, codes = s
    cc = dict(codes=to_dev(codes), bits=2, kmean=to_dev(kmean), chan=to_dev(chan))
    got = select_pages(*to_dev(q, klo, khi, table, num), None, 64, 1, 2, **cc)
    rp, rn, rb = ref.select_pages(*to_dev(q, klo, khi, table, num), None, 64, 1, 2, **cc)
    assert torch.equal(got[1].cpu(), rn.cpu())
    # bf16 dots: near-tied pages may swap at the cut; nearly every page must agree
    for h in range(2):
        m = int(rn[0, h])
        same = len(set(got[2][0, h, :m].tolist()) & set(rb[0, h, :m].tolist()))
        assert same >= m - 3
