"""The CPU engine's paged decode attention (kernels/paged_decode_cpu.py) vs plain float64
softmax attention over the unpaged K/V and vs ``kernels.ref``: odd lengths, GQA and MHA, NaN
in every unwritten token slot and unused page, garbage page-table entries past num_pages,
per-KV-head selections of different sizes, one plan reused by several layers, the fp32-only
fast path's fallback for other dtypes. CPU tensors always (it is the CPU path)."""
import pytest
import torch

from sparseserve.kernels import paged_decode_attention as dispatch_decode
from sparseserve.kernels import ref
from sparseserve.kernels.paged_decode_cpu import (decode_planned, paged_decode_attention,
                                                  plan_decode)
from tests.kernels.test_paged_decode import GARBAGE, _dense_attention, _paged

CPU = torch.device("cpu")
TOL64 = dict(rtol=1e-5, atol=2e-5)


def _check(out, expect):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expect.double(), **TOL64)


@pytest.mark.parametrize("Hq,Hkv,D,ps", [(9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 64, 32),
                                         (2, 1, 16, 8)])
def test_dense_odd_lengths(Hq, Hkv, D, ps):
    gen = torch.Generator().manual_seed(Hq * 100 + D + ps)
    lens = [1, 17, 54, 97, 200]
    ks, vs, kc, vc, table, npg, last = _paged(lens, Hkv, D, ps, gen, device=CPU)
    q = torch.randn(len(lens), Hq, D, generator=gen)
    out = paged_decode_attention(q, kc, vc, table, npg, last, D ** -0.5)
    _check(out, _dense_attention(q, ks, vs, D ** -0.5))
    _check(out, ref.paged_decode_attention(q, kc, vc, table, npg, last, D ** -0.5))


def test_long_4097():
    gen = torch.Generator().manual_seed(4097)
    ks, vs, kc, vc, table, npg, last = _paged([4097, 33], 3, 64, 16, gen, device=CPU)
    q = torch.randn(2, 9, 64, generator=gen)
    _check(paged_decode_attention(q, kc, vc, table, npg, last, 0.125),
           _dense_attention(q, ks, vs, 0.125))


def test_selection_per_kv_head():
    """Each KV head attends its own subset of pages (sparse decode): different num_pages per
    (request, head), pages in any order, the partial last page last, garbage beyond."""
    gen = torch.Generator().manual_seed(77)
    Hq, Hkv, D, ps = 6, 3, 32, 16
    lens = [1, 17, 97, 300, 54]
    ks, vs, kc, vc, full, npg_full, last = _paged(lens, Hkv, D, ps, gen, device=CPU)
    B, W = len(lens), full.shape[-1] + 2
    table = torch.tensor(GARBAGE * (B * Hkv * W), dtype=torch.int32)[: B * Hkv * W]
    table = table.view(B, Hkv, W).clone()
    npg = torch.zeros(B, Hkv, dtype=torch.int32)
    token_sets = []
    for b, L in enumerate(lens):
        n = int(npg_full[b, 0])
        sets = []
        for h in range(Hkv):
            k_sel = int(torch.randint(0, n, (1,), generator=gen))
            chosen = torch.randperm(n - 1, generator=gen)[:k_sel].tolist() if n > 1 else []
            entries = chosen + [n - 1]
            table[b, h, : len(entries)] = full[b, h, entries]
            npg[b, h] = len(entries)
            sets.append(torch.tensor([j * ps + t for j in entries
                                      for t in range(min(ps, L - j * ps))]))
        token_sets.append(sets)
    q = torch.randn(B, Hq, D, generator=gen)
    out = paged_decode_attention(q, kc, vc, table, npg, last, 0.3)
    _check(out, _dense_attention(q, ks, vs, 0.3, token_sets))


def test_plan_reused_by_layers():
    """One plan per step, every layer's caches read through it."""
    gen = torch.Generator().manual_seed(8)
    Hq, Hkv, D, ps = 9, 3, 64, 16
    lens = [17, 54, 97]
    ks0, vs0, kc0, vc0, table, npg, last = _paged(lens, Hkv, D, ps, gen, device=CPU)
    plan = plan_decode(table, npg, last, ps, Hq // Hkv)
    # a second layer: other values at the same pages
    kc1, vc1 = kc0 * 2 - 1, vc0.flip(-1)
    for kc, vc in ((kc0, vc0), (kc1, vc1), (kc0, vc0)):
        q = torch.randn(len(lens), Hq, D, generator=gen)
        _check(decode_planned(q, kc, vc, plan, 0.125),
               ref.paged_decode_attention(q, kc, vc, table, npg, last, 0.125))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_fall_back_to_the_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    ks, vs, kc, vc, table, npg, last = _paged([17, 54], 2, 64, 16, gen, dtype=dtype,
                                              device=CPU)
    q = torch.randn(2, 4, 64, generator=gen).to(dtype)
    out = paged_decode_attention(q, kc, vc, table, npg, last, 0.125)
    assert out.dtype == dtype
    assert torch.equal(out, ref.paged_decode_attention(q, kc, vc, table, npg, last, 0.125))


def test_dispatch_auto_on_cpu_and_out_argument():
    gen = torch.Generator().manual_seed(3)
    ks, vs, kc, vc, table, npg, last = _paged([54, 17, 1], 2, 64, 16, gen, device=CPU)
    q = torch.randn(3, 8, 64, generator=gen)
    expect = _dense_attention(q, ks, vs, 0.125)
    out = torch.full_like(q, float("nan"))
    res = dispatch_decode(q, kc, vc, table, npg, last, 0.125, out=out)
    assert res.data_ptr() == out.data_ptr()
    _check(out, expect)
    _check(dispatch_decode(q, kc, vc, table, npg, last, 0.125, backend="torch"), expect)
