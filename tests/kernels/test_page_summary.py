"""Page summaries (Quest min/max, ArkVale radius): Triton kernel (interpreter on CPU) vs
``kernels.ref`` vs a per-page loop. Token slots past num_tokens hold NaN; padding ids (< 0)
must write nothing; unlisted summary rows must stay untouched."""
import math

import pytest
import torch

from sparseserve.kernels import ref
from sparseserve.kernels import update_page_summaries as _dispatch_summaries
from sparseserve.kernels.page_summary import update_page_summaries as _triton_summaries

from tests.kernels import _on_dev  # noqa: E402  (shared: Triton entry points on DEV)


update_page_summaries = _on_dev(_triton_summaries)
dispatch_summaries = _on_dev(_dispatch_summaries)

SENTINEL = 12345.0


def _case(lens, ps, D, gen, pad=3):
    """Pages of requests of the given lengths in a NaN-filled pool, listed in random order with
    padding entries (-1) mixed in. Returns k_cache [P, ps, D], page_ids [N], num_tokens [N]."""
    counts = []
    for L in lens:
        n = math.ceil(L / ps)
        counts += [ps] * (n - 1) + [L - (n - 1) * ps]
    P = len(counts) + 4
    k_cache = torch.full((P, ps, D), float("nan"))
    phys = torch.randperm(P, generator=gen)[: len(counts)]
    for pid, t in zip(phys.tolist(), counts):
        k_cache[pid, :t] = torch.randn(t, D, generator=gen) * 3 + 1
    ids = torch.cat([phys, torch.full((pad,), -1, dtype=torch.long)])
    nt = torch.cat([torch.tensor(counts), torch.full((pad,), 7)])
    order = torch.randperm(len(ids), generator=gen)
    return k_cache, ids[order].to(torch.int32), nt[order].to(torch.int32)


def _loop_reference(k_cache, ids, nt, S, D):
    kmin = torch.full((S, D), SENTINEL)
    kmax = torch.full((S, D), SENTINEL)
    krad = torch.full((S, D), SENTINEL)
    for pid, t in zip(ids.tolist(), nt.tolist()):
        if pid < 0:
            continue
        k = k_cache[pid, :t].double()
        mn, mx = k.min(0).values, k.max(0).values
        kmin[pid], kmax[pid] = mn.float(), mx.float()
        krad[pid] = ((mn + mx) / 2 - k).abs().mean(0).float()
    return kmin, kmax, krad


def _buffers(S, D):
    return [torch.full((S, D), SENTINEL) for _ in range(3)]


@pytest.mark.parametrize("ps,D", [(32, 64), (16, 128), (32, 128), (16, 64)])
def test_summaries_odd_lengths(ps, D):
    gen = torch.Generator().manual_seed(ps + D)
    lens = [1, 17, 54, 97, 4097] if (ps, D) == (32, 64) else [1, 17, 54, 97]
    k_cache, ids, nt = _case(lens, ps, D, gen)
    S = k_cache.shape[0] + 2                      # summary table may be larger than the pool
    expect = _loop_reference(k_cache, ids, nt, S, D)
    for fn in (update_page_summaries, ref.update_page_summaries):
        kmin, kmax, krad = _buffers(S, D)
        fn(k_cache, ids, nt, kmin, kmax, krad)
        for got, exp in zip((kmin, kmax, krad), expect):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


def test_summaries_without_radius_and_dispatch():
    gen = torch.Generator().manual_seed(9)
    k_cache, ids, nt = _case([54, 17], 16, 64, gen)
    S = k_cache.shape[0]
    exp_min, exp_max, _ = _loop_reference(k_cache, ids, nt, S, 64)
    for kwargs in ({}, {"backend": "triton"}, {"backend": "torch"}):
        kmin, kmax, _ = _buffers(S, 64)
        dispatch_summaries(k_cache, ids, nt, kmin, kmax, None, **kwargs)
        torch.testing.assert_close(kmin, exp_min)
        torch.testing.assert_close(kmax, exp_max)


def test_summaries_all_padding_writes_nothing():
    k_cache = torch.randn(4, 16, 64)
    ids = torch.full((5,), -1, dtype=torch.int32)
    nt = torch.full((5,), 16, dtype=torch.int32)
    kmin, kmax, krad = _buffers(4, 64)
    update_page_summaries(k_cache, ids, nt, kmin, kmax, krad)
    for t in (kmin, kmax, krad):
        assert (t == SENTINEL).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_summaries_bf16_cuda():
    gen = torch.Generator().manual_seed(2)
    k_cache, ids, nt = _case([1, 17, 54, 97, 4097], 32, 128, gen)
    S = k_cache.shape[0]
    kc = k_cache.to(torch.bfloat16)
    outs = []
    for fn, dev in ((update_page_summaries, "cuda"), (ref.update_page_summaries, "cpu")):
        bufs = [b.to(torch.bfloat16).to(dev) for b in _buffers(S, 128)]
        fn(kc.to(dev), ids.to(dev), nt.to(dev), *bufs)
        outs.append([b.float().cpu() for b in bufs])
    for got, exp in zip(*outs):
        torch.testing.assert_close(got, exp, rtol=1e-2, atol=1e-2)
