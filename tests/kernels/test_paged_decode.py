"""Paged decode attention: Triton kernel (compiled on CUDA, interpreted on CPU) vs ``kernels.ref``
(on the same device) vs plain dense softmax attention over the unpaged K/V (float64 on the CPU). Pages are a random permutation of physical ids, unused
token slots and unused pages hold NaN, page-table entries past num_pages hold garbage."""
import math

import pytest
import torch

from sparseserve.kernels import paged_decode_attention as dispatch_decode
from sparseserve.kernels import ref
from sparseserve.kernels.paged_decode import default_num_splits, paged_decode_attention

from tests.conftest import DEVICE
from tests.kernels import TOL, to_dev

ODD = (1, 17, 54, 97)
GARBAGE = (-7, 2**30, 123456789)


def _paged(lens, Hkv, D, ps, gen, dtype=torch.float32, extra_pages=5, device=DEVICE):
    """Random K/V per (request, kv head) scattered into a NaN-filled pool of pages.

    Returns dense K/V lists ([Hkv, L, D] per request, on the CPU: the float64 reference's
    input), then on ``device``: caches [P, ps, D], the full page table [B, Hkv, W] (valid entries
    in token order, garbage beyond), num_pages [B, Hkv], last_len [B].
    """
    n_pages = [math.ceil(L / ps) for L in lens]
    W = max(n_pages)
    P = sum(n_pages) * Hkv + extra_pages
    perm = torch.randperm(P, generator=gen)
    k_cache = torch.full((P, ps, D), float("nan"), dtype=dtype)
    v_cache = torch.full((P, ps, D), float("nan"), dtype=dtype)
    table = torch.tensor(GARBAGE * (len(lens) * Hkv * W), dtype=torch.int32)[: len(lens) * Hkv * W]
    table = table.view(len(lens), Hkv, W).clone()
    ks, vs, nxt = [], [], 0
    for b, L in enumerate(lens):
        k = torch.randn(Hkv, L, D, generator=gen).to(dtype)
        v = torch.randn(Hkv, L, D, generator=gen).to(dtype)
        ks.append(k)
        vs.append(v)
        for h in range(Hkv):
            for j in range(n_pages[b]):
                pid = int(perm[nxt])
                nxt += 1
                table[b, h, j] = pid
                t = min(ps, L - j * ps)
                k_cache[pid, :t] = k[h, j * ps: j * ps + t]
                v_cache[pid, :t] = v[h, j * ps: j * ps + t]
    num_pages = torch.tensor(n_pages, dtype=torch.int32).view(-1, 1).repeat(1, Hkv).contiguous()
    last = torch.tensor([L - (n - 1) * ps for L, n in zip(lens, n_pages)], dtype=torch.int32)
    return (ks, vs, k_cache.to(device), v_cache.to(device), table.to(device),
            num_pages.to(device), last.to(device))


def _dense_attention(q, ks, vs, scale, token_sets=None):
    """Plain softmax attention per request from unpaged K/V ([Hkv, L, D]); fp64 on the CPU."""
    q = q.cpu()
    B, Hq, D = q.shape
    Hkv = ks[0].shape[0]
    G = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            k, v = ks[b][h].double(), vs[b][h].double()
            if token_sets is not None:
                idx = token_sets[b][h]
                k, v = k[idx], v[idx]
            p = torch.softmax((k @ q[b, hq].double()) * scale, dim=0)
            out[b, hq] = p @ v
    return out


def _check(out, expect, tol=None):
    """``out`` (on the kernel's device, no NaN) within TOL of its dtype of ``expect``; with
    ``tol``: max abs error below it."""
    assert out.device.type == DEVICE.type and not torch.isnan(out).any()
    if tol is None:
        torch.testing.assert_close(out.double().cpu(), expect.double().cpu(), **TOL[out.dtype])
        return
    err = (out.double().cpu() - expect.double().cpu()).abs().max().item()
    assert err < tol, err


CONFIGS = [  # (Hq, Hkv, D, page_size)
    (8, 2, 64, 32),     # GQA
    (4, 4, 128, 16),    # MHA
    (8, 2, 128, 16),
    (2, 2, 64, 32),
]


@pytest.mark.parametrize("Hq,Hkv,D,ps", CONFIGS)
def test_dense_mixed_batch(Hq, Hkv, D, ps):
    gen = torch.Generator().manual_seed(Hq * 1000 + D + ps)
    lens = list(ODD) + [200]
    ks, vs, kc, vc, table, npg, last = _paged(lens, Hkv, D, ps, gen)
    q = to_dev(torch.randn(len(lens), Hq, D, generator=gen))
    scale = D ** -0.5
    out = paged_decode_attention(q, kc, vc, table, npg, last, scale)
    expect = _dense_attention(q, ks, vs, scale)
    _check(out, expect)
    _check(ref.paged_decode_attention(q, kc, vc, table, npg, last, scale), expect)


@pytest.mark.parametrize("Hq,Hkv,D,ps", [(8, 2, 64, 32), (4, 4, 128, 16)])
def test_dense_long_4097(Hq, Hkv, D, ps):
    gen = torch.Generator().manual_seed(4097 + D)
    ks, vs, kc, vc, table, npg, last = _paged([4097], Hkv, D, ps, gen)
    q = to_dev(torch.randn(1, Hq, D, generator=gen))
    scale = D ** -0.5
    W = table.shape[-1]
    assert default_num_splits(1, Hkv, W, 4) > 1        # the default path for B=1 is split-K
    out = paged_decode_attention(q, kc, vc, table, npg, last, scale)
    _check(out, _dense_attention(q, ks, vs, scale))
    _check(out, ref.paged_decode_attention(q, kc, vc, table, npg, last, scale))


@pytest.mark.parametrize("Hq,Hkv,D,ps", [(8, 2, 64, 32), (4, 4, 128, 16)])
def test_sparse_subset_partial_last(Hq, Hkv, D, ps):
    """Random subset of full pages in random order, the partial last page placed last,
    page table wider than the selection with garbage beyond."""
    gen = torch.Generator().manual_seed(77 + D)
    lens = [1, 17, 97, 300, 54]
    ks, vs, kc, vc, full, npg_full, last = _paged(lens, Hkv, D, ps, gen)
    B, W = len(lens), full.shape[-1] + 3
    full, npg_full = full.cpu(), npg_full.cpu()
    table = torch.tensor(GARBAGE * (B * Hkv * W), dtype=torch.int32)[: B * Hkv * W].view(B, Hkv, W)
    table = table.clone()
    npg = torch.zeros(B, Hkv, dtype=torch.int32)
    token_sets = []
    for b, L in enumerate(lens):
        n = int(npg_full[b, 0])
        sets = []
        for h in range(Hkv):
            k_sel = int(torch.randint(0, n, (1,), generator=gen))   # full pages to keep
            chosen = torch.randperm(n - 1, generator=gen)[:k_sel].tolist() if n > 1 else []
            entries = chosen + [n - 1]                               # partial last page last
            table[b, h, : len(entries)] = full[b, h, entries]
            npg[b, h] = len(entries)
            idx = [j * ps + t for j in entries for t in range(min(ps, L - j * ps))]
            sets.append(torch.tensor(idx))
        token_sets.append(sets)
    q = torch.randn(B, Hq, D, generator=gen)
    scale = 0.3
    expect = _dense_attention(q, ks, vs, scale, token_sets)
    q, table, npg = to_dev(q, table, npg)
    for ns in (None, 1, 3):
        out = paged_decode_attention(q, kc, vc, table, npg, last, scale, num_splits=ns)
        _check(out, expect)
    _check(ref.paged_decode_attention(q, kc, vc, table, npg, last, scale), expect)


def test_sparse_full_pages_only():
    """Selection without the request's partial page: every listed entry is a full page
    (last_page_len = page_size for this call)."""
    gen = torch.Generator().manual_seed(5)
    Hq, Hkv, D, ps = 8, 2, 64, 16
    lens = [160, 96]
    ks, vs, kc, vc, full, npg_full, _ = _paged(lens, Hkv, D, ps, gen)
    npg = npg_full.clone()
    table = full.clone()
    for b in range(2):   # reverse each valid list: the order of full pages is free
        n = int(npg[b, 0])
        table[b, :, :n] = full[b, :, :n].flip(-1)
    last = torch.full((2,), ps, dtype=torch.int32, device=DEVICE)
    q = to_dev(torch.randn(2, Hq, D, generator=gen))
    out = paged_decode_attention(q, kc, vc, table, npg, last, 0.125)
    _check(out, _dense_attention(q, ks, vs, 0.125))


def test_split_k_matches_single_pass():
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, D, ps = 8, 2, 64, 16
    lens = [1000, 17, 513]
    ks, vs, kc, vc, table, npg, last = _paged(lens, Hkv, D, ps, gen)
    q = to_dev(torch.randn(len(lens), Hq, D, generator=gen))
    single = paged_decode_attention(q, kc, vc, table, npg, last, 0.1, num_splits=1)
    # 7 splits of a 63-page table: short requests leave later splits empty
    for ns in (2, 7, None):
        split = paged_decode_attention(q, kc, vc, table, npg, last, 0.1, num_splits=ns)
        _check(split, single, tol=1e-5)
    _check(single, _dense_attention(q, ks, vs, 0.1))


def test_out_argument_and_dispatch():
    gen = torch.Generator().manual_seed(3)
    ks, vs, kc, vc, table, npg, last = _paged([54, 17], 2, 64, 32, gen)
    q = to_dev(torch.randn(2, 8, 64, generator=gen))
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, kc, vc, table, npg, last, 0.125, out=out)
    assert res.data_ptr() == out.data_ptr()
    expect = _dense_attention(q, ks, vs, 0.125)
    _check(out, expect)
    for backend in (None, "triton", "torch"):  # auto: Triton on CUDA, the reference on CPU
        _check(dispatch_decode(q, kc, vc, table, npg, last, 0.125, backend=backend), expect)


BF16_DOT = pytest.mark.gpu_only("Triton's interpreter multiplies bf16 dot operands' bit "
                                "patterns (triton#11584): bf16 decode runs compiled only")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=BF16_DOT)])
def test_dtypes_against_the_reference(dtype):
    """fp32 / fp16 / bf16 caches: the kernel against ``ref`` on the same rounded inputs and
    against fp64 attention, both within TOL of the dtype."""
    gen = torch.Generator().manual_seed(21)
    lens = [1, 17, 54, 97]
    ks, vs, kc, vc, table, npg, last = _paged(lens, 2, 64, 16, gen, dtype=dtype)
    q = torch.randn(len(lens), 8, 64, generator=gen).to(dtype)
    expect = _dense_attention(q, ks, vs, 0.125)
    q = to_dev(q)
    for ns in (None, 1, 3):
        out = paged_decode_attention(q, kc, vc, table, npg, last, 0.125, num_splits=ns)
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref.paged_decode_attention(
            q, kc, vc, table, npg, last, 0.125), **TOL[dtype])
        _check(out, expect)


@pytest.mark.gpu_only("Llama-3-8B head shapes at 20k tokens in bf16: too slow (and bf16 dots "
                      "wrong, triton#11584) in the interpreter")
@pytest.mark.parametrize("Hq,Hkv,D,ps", [(32, 8, 128, 32), (8, 2, 64, 16), (4, 4, 128, 32)])
def test_bf16_cuda(Hq, Hkv, D, ps):
    gen = torch.Generator().manual_seed(1)
    lens = [1, 17, 54, 97, 4097, 20000]
    ks, vs, kc, vc, table, npg, last = _paged(lens, Hkv, D, ps, gen, dtype=torch.bfloat16)
    q = torch.randn(len(lens), Hq, D, generator=gen).to(torch.bfloat16)
    expect = _dense_attention(q, ks, vs, D ** -0.5)
    q = to_dev(q)
    for ns in (None, 1, 8):
        out = paged_decode_attention(q, kc, vc, table, npg, last, D ** -0.5, num_splits=ns)
        err = (out.double().cpu() - expect).norm() / expect.norm()
        assert err < 1e-2, (ns, err.item())


def test_default_num_splits_is_shape_only_and_bounded():
    assert default_num_splits(1, 8, 4096, 2) == 64            # one long request fills the GPU
    assert default_num_splits(1, 8, 64, 2) == 32              # one sparse request: 1 iter/split
    assert default_num_splits(256, 8, 64, 2) == 1             # big batches run unsplit
    assert default_num_splits(64, 8, 4096, 2) == 1
    assert default_num_splits(32, 8, 256, 2) == 4
    assert default_num_splits(4, 2, 1, 4) == 1                # never more splits than iterations
    for B in (1, 3, 64, 1000):
        assert B * 8 * default_num_splits(B, 8, 10**6, 2) <= max(B * 8, 132 * 8)
