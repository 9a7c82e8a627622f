"""Page bounds (Quest, ArkVale; summed over the group or per head) and Quest's mass scores:
Triton kernel (compiled on CUDA, interpreted on CPU) vs ``kernels.ref`` (same device) vs the literal per-(head, page) formula (float64 on the CPU). Page-table entries past num_pages hold garbage (negative or
out-of-range ids) and must score -inf without being read."""
import math

import pytest
import torch

from sparseserve.kernels import head_bounds, ref
from sparseserve.kernels import score_pages as dispatch_scores
from sparseserve.kernels.page_scores import score_pages

from tests.conftest import DEVICE
from tests.kernels import close, to_dev

GARBAGE = (-3, 2**30, 99999)


def _case(lens, Hq, Hkv, D, ps, gen, extra_w=2):
    """Summaries for requests of the given lengths, on the CPU; returns q [B, Hq, D],
    kmin/kmax/krad [S, D], page_table [B, Hkv, W] (random permutation of summary rows, garbage
    beyond), num_pages."""
    n = [math.ceil(L / ps) for L in lens]
    B, W = len(lens), max(n) + extra_w
    S = sum(n) * Hkv + 3
    mid = torch.randn(S, D, generator=gen)
    half = torch.rand(S, D, generator=gen) * 2
    kmin, kmax = mid - half, mid + half
    krad = torch.rand(S, D, generator=gen) * half          # radius <= half-width, >= 0
    table = torch.tensor(GARBAGE * (B * Hkv * W))[: B * Hkv * W].view(B, Hkv, W).to(torch.int32)
    table = table.clone()
    perm = torch.randperm(S, generator=gen).to(torch.int32)
    nxt = 0
    num_pages = torch.zeros(B, Hkv, dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv):
            table[b, h, : n[b]] = perm[nxt: nxt + n[b]]
            nxt += n[b]
            num_pages[b, h] = n[b]
    q = torch.randn(B, Hq, D, generator=gen)
    return q, kmin, kmax, krad, table, num_pages


def _literal(q, kmin, kmax, krad, table, num_pages, mode):
    """The formula page by page, float64 on the CPU (inputs on the CPU)."""
    B, Hq, D = q.shape
    _, Hkv, W = table.shape
    G = Hq // Hkv
    out = torch.full((B, Hkv, W), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            for w in range(int(num_pages[b, h])):
                p = int(table[b, h, w])
                M, m = kmax[p].double(), kmin[p].double()
                if mode == "arkvale":
                    c, r = (M + m) / 2, krad[p].double()
                    M, m = c + r, c - r
                qs = q[b, h * G:(h + 1) * G].double()        # [G, D]
                out[b, h, w] = torch.maximum(qs * M, qs * m).sum()
    return out


CONFIGS = [(8, 2, 64, 32), (4, 4, 128, 16), (8, 2, 128, 16), (4, 4, 64, 32)]


@pytest.mark.parametrize("mode", ["quest", "arkvale"])
@pytest.mark.parametrize("Hq,Hkv,D,ps", CONFIGS)
def test_scores_mixed_batch(Hq, Hkv, D, ps, mode):
    gen = torch.Generator().manual_seed(Hq + D + ps)
    lens = [1, 17, 54, 97, 4097] if (Hq, D) == (8, 64) else [1, 17, 54, 97]
    q, kmin, kmax, krad, table, npg = _case(lens, Hq, Hkv, D, ps, gen)
    expect = _literal(q, kmin, kmax, krad, table, npg, mode)
    q, kmin, kmax, krad, table, npg = to_dev(q, kmin, kmax, krad, table, npg)
    for fn in (score_pages, ref.score_pages):
        got = fn(q, kmin, kmax, krad if mode == "arkvale" else None, table, npg, mode)
        assert got.dtype == torch.float32 and got.shape == table.shape
        assert got.device == q.device
        close(got, expect)


def test_scores_topk_and_dispatch():
    gen = torch.Generator().manual_seed(4)
    q, kmin, kmax, krad, table, npg = to_dev(*_case([300, 17], 8, 2, 64, 32, gen, extra_w=5))
    out = torch.full(table.shape, float("nan"), device=DEVICE)
    res = score_pages(q, kmin, kmax, krad, table, npg, "arkvale", out=out)
    assert res.data_ptr() == out.data_ptr()
    for backend in (None, "torch", "triton"):
        got = dispatch_scores(q, kmin, kmax, krad, table, npg, "arkvale", backend=backend)
        torch.testing.assert_close(got, out)
    # fixed-size top-k never picks an invalid entry while enough valid ones exist
    k = 2
    top = torch.topk(out, k, dim=-1).indices                 # [B, Hkv, k]
    n_valid = (top < npg.unsqueeze(-1)).sum(-1)
    assert (n_valid == npg.clamp(max=k)).all()
    with pytest.raises(ValueError):
        score_pages(q, kmin, kmax, None, table, npg, "arkvale")
    with pytest.raises(ValueError):
        score_pages(q, kmin, kmax, None, table, npg, "nope")


@pytest.mark.parametrize("Hq,Hkv", [(6, 2), (8, 2), (4, 4)])  # GQA groups 3, 4 and MHA
def test_per_head_bounds_and_page_mass(Hq, Hkv):
    """per_head: each head's bound (the literal formula with G = 1 per head); page_mass (Quest's
    score): softmax per head over the full pages (kept ones too, not the partial last page),
    summed over the group, on the scored pages; +inf on kept / last pages, -inf past
    num_pages; the variant normalising over the scored pages only sums to G per row; the
    dispatched bounds (Triton per-head kernel / torch) give the same masses."""
    gen = torch.Generator().manual_seed(Hq * 10 + Hkv)
    D, ps, sink, local = 32, 16, 1, 2
    q, kmin, kmax, krad, table, npg = _case([1, 17, 54, 97, 300], Hq, Hkv, D, ps, gen)
    G = Hq // Hkv
    heads = torch.stack([_literal(q.view(-1, Hkv, G, D)[:, :, g].contiguous(), kmin, kmax,
                                  krad, table, npg, "quest") for g in range(G)], dim=2)
    q, kmin, kmax, krad, table, npg, heads = to_dev(q, kmin, kmax, krad, table, npg, heads)
    for fn in (score_pages, ref.score_pages):
        got = fn(q, kmin, kmax, None, table, npg, "quest", per_head=True)
        assert got.shape == (*table.shape[:2], G, table.shape[2])
        close(got.double(), heads)
    close(ref.head_bounds(q, kmin, kmax, table, npg).double(), heads)
    mass = ref.page_mass(q, kmin, kmax, table, npg, sink, local)
    W = table.shape[2]
    blk = torch.arange(W, device=DEVICE).view(1, 1, W)
    n = npg.long().unsqueeze(-1)
    scored = (blk >= sink) & (blk < n - local) & (blk < n - 1)
    for kept_too in (True, False):
        norm = (blk < n - 1) if kept_too else scored
        x = (heads * D ** -0.5).masked_fill(~norm.unsqueeze(2), float("-inf"))
        want = torch.softmax(x, dim=-1).nan_to_num(0.0).sum(2)
        got = ref.mass_from_bounds(heads.float(), npg, sink, local, D ** -0.5,
                                   normalise_kept=kept_too)
        torch.testing.assert_close(got.masked_fill(~scored, 0).double(),
                                   want.masked_fill(~scored, 0), rtol=1e-4, atol=1e-6)
    has = scored.any(-1)
    torch.testing.assert_close(got.masked_fill(~scored, 0).sum(-1)[has],
                               torch.full_like(got[..., 0][has], float(G)))
    x = (heads * D ** -0.5).masked_fill(~(blk < n - 1).unsqueeze(2), float("-inf"))
    torch.testing.assert_close(mass.masked_fill(~scored, 0).double(),
                               torch.softmax(x, -1).nan_to_num(0.0).sum(2).masked_fill(~scored, 0),
                               rtol=1e-4, atol=1e-6)
    assert torch.isinf(mass[(blk < n) & ~scored]).all() and (mass[(blk < n) & ~scored] > 0).all()
    assert (mass[blk >= n] == float("-inf")).all()
    for backend in ("torch", "triton"):  # the generic path: dispatched bounds, then the mass
        u = head_bounds(q, kmin, kmax, table, npg, backend=backend)
        got = ref.mass_from_bounds(u, npg, sink, local, D ** -0.5)
        torch.testing.assert_close(got, mass, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["quest", "arkvale"])
def test_scores_half_dtypes(mode, dtype):
    """fp16 / bf16 queries and summaries (fp32 scores) against the reference on the same rounded
    values in fp32, within TOL of the input dtype; Llama-3-8B head shapes, lengths to 30k on a
    GPU, to 4097 interpreted."""
    gen = torch.Generator().manual_seed(6)
    lens = [1, 17, 54, 97, 4097] + ([30000] if DEVICE.type == "cuda" else [])
    q, kmin, kmax, krad, table, npg = _case(lens, 32, 8, 128, 32, gen)
    half = to_dev(*[t.to(dtype) for t in (q, kmin, kmax, krad)])
    table, npg = to_dev(table, npg)
    expect = ref.score_pages(*[t.float() for t in half], table, npg, mode)
    got = score_pages(*half, table, npg, mode)
    assert got.dtype == torch.float32 and got.device == expect.device
    finite = torch.isfinite(expect)
    assert torch.equal(finite, torch.isfinite(got))
    close(got[finite], expect[finite], dtype)
