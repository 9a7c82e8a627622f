"""The CPU engine's paged decode attention (kernels/paged_decode_cpu.py) vs plain float64
softmax attention over the unpaged K/V and vs ``kernels.ref``: odd lengths, GQA and MHA, NaN
in every unwritten token slot and unused page, garbage page-table entries past num_pages,
per-KV-head selections of different sizes, one plan reused by several layers, the fp32-only
fast path's fallback for other dtypes. CPU tensors always (it is the CPU path).

Every case runs on each path: "torch" (gather + bmm + embedding_bag), and, when the C++
kernel builds on this machine (kernels/paged_decode_cpu_fused.py), "fused" (its AVX-512 path
where the machine has it) and "generic" (its scalar path); without a compiler those two skip."""
import pytest
import torch

from sparseserve.kernels import paged_decode_attention as dispatch_decode
from sparseserve.kernels import ref
from sparseserve.kernels import paged_decode_cpu_fused as fused_kernel
from sparseserve.kernels.paged_decode_cpu import (decode_planned, paged_decode_attention,
                                                  plan_decode)
from tests.kernels.cpu_build import require_built
from tests.kernels.test_paged_decode import GARBAGE, _dense_attention, _paged

CPU = torch.device("cpu")
TOL64 = dict(rtol=1e-5, atol=2e-5)


PATHS = ["torch", "fused", "generic"]


def _need(path):
    if path != "torch":
        require_built(fused_kernel.available(), "fused CPU paged decode kernel",
                      "SPARSESERVE_CPU_DECODE")


def _attend(path, q, kc, vc, table, npg, last, scale):
    """The decode attention through one path (``_need(path)`` first)."""
    if path == "torch":
        return paged_decode_attention(q, kc, vc, table, npg, last, scale, fused=False)
    return fused_kernel.paged_decode_fused(q, kc, vc, table, npg, last, scale,
                                           generic=path == "generic")


def _check(out, expect):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expect.double(), **TOL64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("Hq,Hkv,D,ps", [(9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 64, 32),
                                         (2, 1, 16, 8), (16, 2, 128, 16), (10, 1, 64, 16),
                                         (3, 3, 64, 16), (4, 2, 64, 16), (10, 2, 64, 8),
                                         (12, 2, 128, 16), (7, 1, 64, 32), (8, 1, 64, 16),
                                         (6, 2, 128, 16), (2, 2, 128, 16)])
def test_dense_odd_lengths(path, Hq, Hkv, D, ps):
    """(9, 3, 64): SmolLM2; G 1..8 at D 64 / 128 take the kernel's vector path (every column
    block width of the AVX2 one: G <= 3, <= 6, 7-8), the others (D 32 / 16, G 10) its scalar
    one."""
    _need(path)
    gen = torch.Generator().manual_seed(Hq * 100 + D + ps)
    lens = [1, 17, 54, 97, 200]
    ks, vs, kc, vc, table, npg, last = _paged(lens, Hkv, D, ps, gen, device=CPU)
    q = torch.randn(len(lens), Hq, D, generator=gen)
    out = _attend(path, q, kc, vc, table, npg, last, D ** -0.5)
    _check(out, _dense_attention(q, ks, vs, D ** -0.5))
    _check(out, ref.paged_decode_attention(q, kc, vc, table, npg, last, D ** -0.5))


@pytest.mark.parametrize("path", PATHS)
def test_long_4097(path):
    _need(path)
    gen = torch.Generator().manual_seed(4097)
    ks, vs, kc, vc, table, npg, last = _paged([4097, 33], 3, 64, 16, gen, device=CPU)
    q = torch.randn(2, 9, 64, generator=gen)
    _check(_attend(path, q, kc, vc, table, npg, last, 0.125),
           _dense_attention(q, ks, vs, 0.125))


@pytest.mark.parametrize("path", PATHS)
def test_selection_per_kv_head(path):
    """Each KV head attends its own subset of pages (sparse decode): different num_pages per
    (request, head), pages in any order, the partial last page last, garbage beyond."""
    _need(path)
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
    out = _attend(path, q, kc, vc, table, npg, last, 0.3)
    _check(out, _dense_attention(q, ks, vs, 0.3, token_sets))


@pytest.mark.parametrize("fused", [False, True])
def test_plan_reused_by_layers(fused):
    """One plan per step, every layer's caches read through it (the torch path's plan, or
    the fused kernel's, which carries only the page table)."""
    _need("fused" if fused else "torch")
    gen = torch.Generator().manual_seed(8)
    Hq, Hkv, D, ps = 9, 3, 64, 16
    lens = [17, 54, 97]
    ks0, vs0, kc0, vc0, table, npg, last = _paged(lens, Hkv, D, ps, gen, device=CPU)
    plan = plan_decode(table, npg, last, ps, Hq // Hkv, fused=fused)
    assert (plan.page_ids is None) == fused
    # a second layer: other values at the same pages
    kc1, vc1 = kc0 * 2 - 1, vc0.flip(-1)
    for kc, vc in ((kc0, vc0), (kc1, vc1), (kc0, vc0)):
        q = torch.randn(len(lens), Hq, D, generator=gen)
        _check(decode_planned(q, kc, vc, plan, 0.125),
               ref.paged_decode_attention(q, kc, vc, table, npg, last, 0.125))


@pytest.mark.parametrize("fused", [False, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_fall_back_to_the_reference(dtype, fused):
    gen = torch.Generator().manual_seed(2)
    ks, vs, kc, vc, table, npg, last = _paged([17, 54], 2, 64, 16, gen, dtype=dtype,
                                              device=CPU)
    q = torch.randn(2, 4, 64, generator=gen).to(dtype)
    out = paged_decode_attention(q, kc, vc, table, npg, last, 0.125, fused=fused)
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


def test_auto_path_is_the_fused_kernel_when_built():
    """plan_decode's default: the fused plan exactly when the kernel builds, and its output is
    the kernel's, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    ks, vs, kc, vc, table, npg, last = _paged([54, 97], 3, 64, 16, gen, device=CPU)
    q = torch.randn(2, 9, 64, generator=gen)
    plan = plan_decode(table, npg, last, 16, 3)
    assert (plan.page_ids is None) == fused_kernel.available()
    out = paged_decode_attention(q, kc, vc, table, npg, last, 0.125)
    if fused_kernel.available():
        assert torch.equal(out, fused_kernel.paged_decode_fused(q, kc, vc, table, npg, last,
                                                                0.125))
    _check(out, _dense_attention(q, ks, vs, 0.125))


def test_fused_threads_agree():
    """Split over (request, KV head) by torch's threads: each pair is computed the same way
    whatever the split, so two threads give one thread's result bit for bit."""
    _need("fused")
    gen = torch.Generator().manual_seed(6)
    ks, vs, kc, vc, table, npg, last = _paged([1, 17, 54, 97, 200, 33], 3, 64, 16, gen,
                                              device=CPU)
    q = torch.randn(6, 9, 64, generator=gen)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_kernel.paged_decode_fused(q, kc, vc, table, npg, last, 0.125)
        torch.set_num_threads(2)
        two = fused_kernel.paged_decode_fused(q, kc, vc, table, npg, last, 0.125)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


@pytest.mark.parametrize("generic", [False, True])
def test_fused_rejects_bad_tables(generic):
    """A page id outside the cache, num_pages 0 or past the table, or a last_page_len outside
    1..page_size raises instead of reading outside the cache."""
    _need("fused")
    gen = torch.Generator().manual_seed(7)
    ks, vs, kc, vc, table, npg, last = _paged([17, 54], 3, 64, 16, gen, device=CPU)
    q = torch.randn(2, 9, 64, generator=gen)
    bad = [(table.clone().index_fill_(2, torch.tensor([0]), kc.shape[0]), npg, last),
           (table, torch.zeros_like(npg), last),
           (table, npg + table.shape[-1], last),
           (table, npg, torch.zeros_like(last)),
           (table, npg, last + 16)]
    for t, n, lst in bad:
        with pytest.raises(RuntimeError):
            fused_kernel.paged_decode_fused(q, kc, vc, t, n, lst, 0.125, generic=generic)


def test_vector_path_matches_the_cpu():
    """The kernel is built with the widest vector path this CPU has (-march=native): AVX-512
    where the CPU has it, else AVX2 + FMA — a build that fell back to the scalar path (as
    every AVX2-only CPU did before the twenty-second session) fails."""
    _need("fused")
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split())
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags here")
    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else ""
    assert fused_kernel.vector_isa() == want
