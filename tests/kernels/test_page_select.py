"""Fused Quest/ArkVale page selection: the Triton kernel (interpreter on CPU, fp32) selects the
same SET of pages as the torch reference (``ref.select_pages`` = score + kept pages + topk),
with the kept pages always in, the last page at num_sel - 1 and num_sel = min(budget, pages).

Scores differ from the reference by float rounding (the kernel sums the group as
``P . M + N . m``), so two data kinds: integer-valued data (exact scores, many ties: the set
must match up to which tied pages fill the last places) and Gaussian data (tolerance near the
threshold; exact set equality whenever the threshold has a clear gap)."""
import pytest
import torch

from sparseserve.kernels import ref
from sparseserve.kernels import select_pages as dispatch_select
from sparseserve.kernels import page_select
from sparseserve.sparse import get_algorithm_class
from sparseserve.sparse.base import LayerSummaries, SparseAlgorithm

from .test_page_scores import _on_dev

select_pages = _on_dev(page_select.select_pages)

GARBAGE = (-3, 2**30, 99999)  # page-table entries past num_pages: never read


def _case(npages, Hq, Hkv, D, W, gen, kind):
    """q [B, Hq, D], kmin/kmax [S, D] (kmin <= kmax), page_table [B, Hkv, W] (distinct random
    rows, garbage past num_pages), num_pages [B, Hkv] (request b has npages[b] on every head
    but the last head of each request gets one page fewer when it can, to vary rows)."""
    B = len(npages)
    S = B * Hkv * W + 1
    if kind == "int":  # exact in fp32 whatever the summation order
        q = torch.randint(-3, 4, (B, Hq, D), generator=gen).float()
        mid = torch.randint(-8, 9, (S, D), generator=gen).float()
        half = torch.randint(0, 4, (S, D), generator=gen).float()
    else:
        q = torch.randn(B, Hq, D, generator=gen)
        mid = torch.randn(S, D, generator=gen)
        half = torch.rand(S, D, generator=gen)
    # odd requests: q >= 0 against boxes shifted down, so every score is negative and the
    # order among negative floats decides the selection
    q[1::2] = q[1::2].abs()
    mid = mid - (8 if kind == "int" else 3)
    table = torch.tensor(GARBAGE * (B * Hkv * W))[: B * Hkv * W].view(B, Hkv, W)
    table = table.to(torch.int32).clone()
    perm = torch.randperm(S - 1, generator=gen).to(torch.int32)
    num = torch.zeros(B, Hkv, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(npages):
        for h in range(Hkv):
            m = n - 1 if (h == Hkv - 1 and Hkv > 1 and n > 1) else n
            table[b, h, :m] = perm[nxt:nxt + m]
            nxt += m
            num[b, h] = m
    return q, mid - half, mid + half, table, num


def _check(got, q, kmin, kmax, table, num, budget, sink, local, tol, block_order=True):
    pages, nsel, blocks = got
    rp, rn, rb = ref.select_pages(q, kmin, kmax, table, num, None, budget, sink, local)
    assert pages.shape == rp.shape and blocks.shape == rb.shape
    assert pages.dtype == torch.int32 and nsel.dtype == torch.int32 and blocks.dtype == torch.int64
    assert torch.equal(nsel, rn)
    B, Hkv, W = table.shape
    K = rp.shape[2]
    s = ref.score_pages(q, kmin, kmax, None, table, num, "quest").double()
    for b in range(B):
        for h in range(Hkv):
            n, m = int(num[b, h]), int(nsel[b, h])
            assert m == min(K, n)
            blk = blocks[b, h].tolist()
            assert blk[m - 1] == n - 1, "last page not at num_sel - 1"
            assert blk[m:] == [n - 1] * (K - m) and pages[b, h, m:].eq(table[b, h, n - 1]).all()
            assert pages[b, h, :m].tolist() == table[b, h, blk[:m]].tolist()
            chosen = blk[:m - 1]
            assert len(set(chosen)) == len(chosen) and all(0 <= w < n - 1 for w in chosen)
            if block_order:
                assert chosen == sorted(chosen)
            cand = list(range(n - 1))
            kept = [w for w in cand if w < sink or w >= n - local]
            others = [w for w in cand if w not in kept]
            k_eff = len(chosen)
            if len(kept) >= k_eff:  # more kept pages than room: the lowest blocks win
                assert chosen == kept[:k_eff]
                continue
            assert set(kept) <= set(chosen)
            rest = sorted((w for w in chosen if w not in kept))
            want = sorted(rb[b, h, :m - 1].tolist())
            ref_rest = [w for w in want if w not in kept]
            thr = min(s[b, h, w].item() for w in ref_rest)  # the reference's k-th score
            sc = {w: s[b, h, w].item() for w in others}
            assert all(w in rest for w in others if sc[w] > thr + tol), "missed a clear winner"
            assert all(sc[w] >= thr - tol for w in rest), "took a clear loser"
            nxt = max((v for w, v in sc.items() if w not in ref_rest), default=float("-inf"))
            if thr - nxt > 2 * tol:  # no tie at the threshold: the sets are equal
                assert rest == sorted(ref_rest)


NPAGES = [1, 2, 3, 17, 54, 97]


@pytest.mark.parametrize("kind", ["int", "normal"])
@pytest.mark.parametrize("Hq,Hkv,D", [(8, 2, 32), (4, 4, 16)])
@pytest.mark.parametrize("budget", [4, 8, 64])
@pytest.mark.parametrize("sink,local", [(0, 1), (1, 2), (2, 4)])
def test_select_matches_reference(kind, Hq, Hkv, D, budget, sink, local):
    gen = torch.Generator().manual_seed(budget * 31 + sink * 7 + local + Hq + (kind == "int"))
    W = 97 + 3
    q, kmin, kmax, table, num = _case(NPAGES, Hq, Hkv, D, W, gen, kind)
    tol = 0.0 if kind == "int" else 1e-3
    splits = 1 if (budget + sink) % 2 else 3  # fused launch / split score + select launches
    got = select_pages(q, kmin, kmax, table, num, None, budget, sink, local, num_splits=splits)
    _check(got, q, kmin, kmax, table, num, budget, sink, local, tol)


@pytest.mark.parametrize("W,npages,max_tile,kind", [
    (5000, [4097, 1, 54], None, "normal"), (5000, [4097, 1, 54], None, "int"),
    (4097, [4097, 3000], 1024, "normal"), (700, [699, 97], 256, "int"),
    (1, [1], None, "int"), (2, [2, 1], None, "normal"), (3, [3, 2, 1], None, "int")])
def test_select_wide_rows_and_chunked_search(kind, W, npages, max_tile, monkeypatch):
    """Rows up to 5000 pages; ``max_tile`` forces the search to re-read the key row in tiles."""
    if max_tile is not None:
        monkeypatch.setattr(page_select, "MAX_TILE", max_tile)
    gen = torch.Generator().manual_seed(W)
    q, kmin, kmax, table, num = _case(npages, 8, 2, 32, W, gen, kind)
    tol = 0.0 if kind == "int" else 1e-3
    for budget, sink, local, splits in ((64, 1, 2, 1), (8, 2, 4, 5)):
        got = select_pages(q, kmin, kmax, table, num, None, budget, sink, local,
                           num_splits=splits)
        _check(got, q, kmin, kmax, table, num, budget, sink, local, tol)


def test_ties_take_lowest_blocks_and_small_budgets():
    """All-equal scores: the lowest non-kept blocks fill the budget; budget 1 and 2 and W
    below the budget give the reference's widths (K = max(1, min(budget - 1, W)) + 1)."""
    gen = torch.Generator().manual_seed(3)
    q, kmin, kmax, table, num = _case([40, 9], 4, 2, 16, 41, gen, "int")
    q.zero_()
    pages, nsel, blocks = select_pages(q, kmin, kmax, table, num, None, 8, 1, 2)
    assert blocks[0, 0, :8].tolist() == [0, 1, 2, 3, 4, 5, 38, 39]
    for budget in (1, 2, 3, 64):
        got = select_pages(q, kmin, kmax, table, num, None, budget, 1, 2)
        want_k = max(1, min(budget - 1, 41)) + 1
        assert got[0].shape[2] == want_k
        _check(got, q, kmin, kmax, table, num, budget, 1, 2, 0.0)
    # more kept pages than the budget holds: the lowest kept blocks, then the last page
    got = select_pages(q, kmin, kmax, table, num, None, 4, 3, 4)
    assert got[2][0, 0].tolist() == [0, 1, 2, 39]


def test_out_buffers_and_dispatch():
    gen = torch.Generator().manual_seed(5)
    q, kmin, kmax, table, num = _case([30, 17], 8, 2, 32, 33, gen, "int")
    outs = (torch.full((2, 2, 8), -7, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
            torch.full((2, 2, 8), -7, dtype=torch.int64))
    res = select_pages(q, kmin, kmax, table, num, None, 8, 1, 2, *outs)
    assert all(r.data_ptr() == o.data_ptr() for r, o in zip(res, outs))
    _check(res, q, kmin, kmax, table, num, 8, 1, 2, 0.0)
    for backend in ("torch", "triton"):
        got = _on_dev(dispatch_select)(q, kmin, kmax, table, num, None, 8, 1, 2,
                                       backend=backend)
        _check(got, q, kmin, kmax, table, num, 8, 1, 2, 0.0, block_order=backend == "triton")
        assert torch.equal(got[1], res[1])
        assert torch.equal(got[2].sort(-1).values, res[2].sort(-1).values)


@pytest.mark.parametrize("algo", ["quest", "arkvale"])
def test_algorithm_select_equals_generic_select(algo, monkeypatch):
    """Quest/ArkVale.select (fused path) picks the same pages as SparseAlgorithm.select;
    fused_select = False is the generic path itself."""
    torch.manual_seed(0)
    B, hkv, G, D, ps, W = 3, 2, 2, 16, 16, 40
    alg = get_algorithm_class(algo)(ps, 8, 1, 2)
    P = B * W * hkv + 1
    k_cache = torch.randn(P, ps, D)
    summ = LayerSummaries({nm: torch.zeros(P, D) for nm in alg.summary_names})
    table = torch.randperm(P - 1)[:B * hkv * W].view(B, hkv, W).int()
    alg.index(k_cache, table.reshape(-1), torch.full((B * hkv * W,), ps, dtype=torch.int32),
              summ, None)
    n = torch.tensor([1, 7, 37], dtype=torch.int32)[:, None].expand(B, hkv).contiguous()
    last = torch.tensor([5, 16, 9], dtype=torch.int32)
    q = torch.randn(B, hkv * G, D)
    want = SparseAlgorithm.select(alg, q, table, n, last, summ, k_cache)
    if torch.cuda.is_available():
        dev = [t.cuda() for t in (q, table, n, last)]
        got = alg.select(*dev, LayerSummaries({k: v.cuda() for k, v in summ.tensors.items()}),
                         None)
        got = type(got)(*[t.cpu() for t in (got.page_table, got.num_pages, got.last_page_len,
                                            got.blocks)])
    else:  # the CPU path dispatches to the reference; run the kernel itself too
        got = alg.select(q, table, n, last, summ, k_cache)
        p, ns, bl = select_pages(q, summ["kmin"], summ["kmax"], table, n, last, 8, 1, 2)
        assert torch.equal(ns, want.num_pages)
        for b in range(B):
            for h in range(hkv):
                m = int(ns[b, h])
                assert set(bl[b, h, :m].tolist()) == set(want.blocks[b, h, :m].tolist())
    assert torch.equal(got.num_pages, want.num_pages) and got.last_page_len is not None
    for b in range(B):
        for h in range(hkv):
            m = int(want.num_pages[b, h])
            assert set(got.blocks[b, h, :m].tolist()) == set(want.blocks[b, h, :m].tolist())
            assert int(got.blocks[b, h, m - 1]) == int(n[b, h]) - 1
            assert got.page_table[b, h, :m].tolist() == table[b, h, got.blocks[b, h, :m]].tolist()
    monkeypatch.setattr(type(alg), "fused_select", False)
    plain = alg.select(q, table, n, last, summ, k_cache)
    assert torch.equal(plain.blocks, want.blocks) and torch.equal(plain.page_table,
                                                                   want.page_table)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_select_bf16_cuda(splits):
    """Llama-3-8B head shapes in bf16 at 128k (W 4096) and beyond MAX_TILE (W 9000)."""
    gen = torch.Generator().manual_seed(6)
    for W, npg in ((4096, [4096, 1, 2000, 4095]), (9000, [9000, 8192])):
        q, kmin, kmax, table, num = _case(npg, 32, 8, 128, W, gen, "normal")
        bf = [t.to(torch.bfloat16) for t in (q, kmin, kmax)]
        got = page_select.select_pages(*[t.cuda() for t in bf], table.cuda(), num.cuda(), None,
                                       64, 1, 2, num_splits=splits)
        got = tuple(t.cpu() for t in got)
        _check(got, *[t.float() for t in bf], table, num, 64, 1, 2, 5e-2)
