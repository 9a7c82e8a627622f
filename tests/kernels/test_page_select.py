"""Fused Quest/ArkVale page selection by estimated attention mass: the Triton kernel
(compiled on CUDA, interpreted on CPU) selects the same SET of pages as the torch reference
(``ref.select_pages`` = ``page_mass`` + kept pages + topk), with the kept pages always in, the
last page at num_sel - 1 and num_sel = min(budget, pages).

Masses differ from the reference by float rounding (the kernel forms per-head bounds with dots
and exponentiates in base 2), so the check is against float64 masses with a relative tolerance
near the threshold, and exact set equality whenever the threshold has a clear gap. Data kinds:
"normal" (Gaussian: smooth masses) and "peaked" (large queries: each head's softmax is sharp,
many masses underflow to 0 in fp32 and tie there; the set must still hold every page of
non-negligible mass); all-equal masses (zero queries) check the lowest-block tie rule."""
import pytest
import torch

from sparseserve.kernels import ref
from sparseserve.kernels import select_pages as dispatch_select
from sparseserve.kernels import page_select
from sparseserve.sparse import get_algorithm_class
from sparseserve.sparse.base import LayerSummaries, SparseAlgorithm

from tests.conftest import DEVICE
from tests.kernels import to_dev


def select_pages(*args, **kwargs):
    """The Triton entry point (page_select.select_pages) on DEVICE: tensor arguments are moved
    there; the outputs stay there (checked by ``_check``)."""
    return page_select.select_pages(*to_dev(*args), **kwargs)

GARBAGE = (-3, 2**30, 99999)  # page-table entries past num_pages: never read


def _case(npages, Hq, Hkv, D, W, gen, kind, n_sub=1):
    """q [B, Hq, D], kmin/kmax [S, D] (kmin <= kmax), page_table [B, Hkv, W] (distinct random
    rows, garbage past num_pages), num_pages [B, Hkv] (request b has npages[b] on every head
    but the last head of each request gets one page fewer when it can, to vary rows)."""
    B = len(npages)
    S = B * Hkv * W + 1
    q = torch.randn(B, Hq, D, generator=gen) * (60.0 if kind == "peaked" else 1.0)
    mid = torch.randn(S, n_sub * D, generator=gen)  # n_sub boxes of D channels per page row
    half = torch.rand(S, n_sub * D, generator=gen)
    q[1::2] = q[1::2].abs()  # odd requests: one-signed queries (only M or only m is read)
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


def _mass64(q, kmin, kmax, table, num, sink, local, n_sub=1):
    """[B, Hkv, W] float64 masses of the scored pages (the literal per-head bound, a softmax
    per head over the full pages — kept ones included, not the last —, summed over the
    group); -inf elsewhere."""
    B, Hq, D = q.shape
    _, Hkv, W = table.shape
    G = Hq // Hkv
    blk = torch.arange(W).view(1, 1, W)
    n = num.long().unsqueeze(-1)
    scored = (blk >= sink) & (blk < n - local) & (blk < n - 1)
    ids = torch.where(blk < n, table.long(), 0)
    hi = kmax[ids].double().view(B, Hkv, W, n_sub, D)             # [B, Hkv, W, n, D]
    lo = kmin[ids].double().view(B, Hkv, W, n_sub, D)
    qg = q.double().view(B, Hkv, G, 1, 1, D)
    # the page's bound: the max over its boxes
    u = torch.maximum(qg * hi.unsqueeze(2), qg * lo.unsqueeze(2)).sum(-1).amax(-1)
    x = (u * D ** -0.5).masked_fill(~(blk < n - 1).unsqueeze(2), float("-inf"))
    mass = torch.softmax(x, dim=-1).nan_to_num(0.0).sum(2)
    return mass.masked_fill(~scored, float("-inf"))


def _check(got, q, kmin, kmax, table, num, budget, sink, local, rtol, block_order=True,
           n_sub=1):
    """``got`` (the kernel's outputs, on DEVICE) against ``ref.select_pages`` run on DEVICE and
    the float64 masses; the per-row set checks read both back to the CPU."""
    assert all(t.device.type == DEVICE.type for t in got)
    rp, rn, rb = ref.select_pages(*to_dev(q, kmin, kmax, table, num), None, budget, sink, local,
                                  n_sub=n_sub)
    assert all(t.device.type == DEVICE.type for t in (rp, rn, rb))
    pages, nsel, blocks = (t.cpu() for t in got)
    rp, rn, rb = rp.cpu(), rn.cpu(), rb.cpu()
    q, kmin, kmax, table, num = (t.cpu() for t in (q, kmin, kmax, table, num))
    assert pages.shape == rp.shape and blocks.shape == rb.shape
    assert pages.dtype == torch.int32 and nsel.dtype == torch.int32 and blocks.dtype == torch.int64
    assert torch.equal(nsel, rn)
    B, Hkv, W = table.shape
    K = rp.shape[2]
    s = _mass64(q, kmin, kmax, table, num, sink, local, n_sub)
    atol = 1e-30  # fp32 underflow: masses below it may tie at 0
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
            # the true k-th mass among the scored pages (float64), with the kernel's and the
            # reference's selections both checked against it
            sc = {w: s[b, h, w].item() for w in others}
            ranked = sorted(sc.values(), reverse=True)
            k_rest = k_eff - len(kept)
            thr = ranked[k_rest - 1]
            nxt = ranked[k_rest] if k_rest < len(ranked) else 0.0
            want = sorted(w for w in others if sc[w] >= thr)
            for sel in (chosen, rb[b, h, :m - 1].tolist()):
                rest = sorted(w for w in sel if w not in kept)
                assert set(kept) <= set(sel) and len(rest) == k_rest
                assert all(w in rest for w in others if sc[w] > thr * (1 + rtol) + atol), \
                    "missed a clear winner"
                assert all(sc[w] >= thr * (1 - rtol) - atol for w in rest), "took a clear loser"
                if thr > nxt * (1 + 2 * rtol) + atol:  # a clear gap at the threshold
                    assert rest == want


NPAGES = [1, 2, 3, 17, 54, 97]


SHAPES = [(8, 2, 32), (6, 2, 32), (4, 4, 16)]  # GQA group 4, group 3, MHA (group 1)


@pytest.mark.parametrize("kind", ["normal", "peaked"])
@pytest.mark.parametrize("Hq,Hkv,D", SHAPES)
@pytest.mark.parametrize("budget,sink,local", [(4, 0, 1), (8, 1, 2), (64, 2, 4), (8, 2, 4),
                                                (64, 1, 2)])
def test_select_matches_reference(kind, Hq, Hkv, D, budget, sink, local):
    gen = torch.Generator().manual_seed(budget * 31 + sink * 7 + local + Hq + (kind == "peaked"))
    W = 97 + 3
    q, kmin, kmax, table, num = _case(NPAGES, Hq, Hkv, D, W, gen, kind)
    splits = 1 if (budget + sink + Hq) % 2 else 3  # fused launch / split score + select
    got = select_pages(q, kmin, kmax, table, num, None, budget, sink, local, num_splits=splits)
    _check(got, q, kmin, kmax, table, num, budget, sink, local, 1e-3)


@pytest.mark.parametrize("W,npages,max_tile,kind", [
    (5000, [4097, 1, 54], None, "normal"), (4097, [4097, 3000], 1024, "peaked"),
    (700, [699, 97], 256, "normal"), (1, [1], None, "normal"), (2, [2, 1], None, "peaked"),
    (3, [3, 2, 1], None, "normal")])
def test_select_wide_rows_and_chunked_search(kind, W, npages, max_tile, monkeypatch):
    """Rows up to 5000 pages; ``max_tile`` forces the search to re-read the key row in tiles."""
    if max_tile is not None:
        monkeypatch.setattr(page_select, "MAX_TILE", max_tile)
    gen = torch.Generator().manual_seed(W)
    q, kmin, kmax, table, num = _case(npages, 6, 2, 32, W, gen, kind)
    for budget, sink, local, splits in ((64, 1, 2, 1), (8, 2, 4, 5)):
        got = select_pages(q, kmin, kmax, table, num, None, budget, sink, local,
                           num_splits=splits)
        _check(got, q, kmin, kmax, table, num, budget, sink, local, 1e-3)


@pytest.mark.parametrize("n_sub", [2, 4])
@pytest.mark.parametrize("kind", ["normal", "peaked"])
@pytest.mark.parametrize("Hq,Hkv,D", SHAPES)
def test_select_sub_page_boxes_match_reference(n_sub, kind, Hq, Hkv, D):
    """n_sub boxes per page row (sub-page partitions): the page's bound per head is the max of
    its boxes' bounds; kernel == reference == float64 at 1, 2, 3, 17, 54, 97 pages."""
    gen = torch.Generator().manual_seed(n_sub * 13 + Hq + (kind == "peaked"))
    q, kmin, kmax, table, num = _case(NPAGES, Hq, Hkv, D, 100, gen, kind, n_sub)
    for budget, sink, local, splits in ((8, 1, 2, 1), (16, 0, 1, 3)):
        got = select_pages(q, kmin, kmax, table, num, None, budget, sink, local,
                           num_splits=splits, n_sub=n_sub)
        _check(got, q, kmin, kmax, table, num, budget, sink, local, 1e-3, n_sub=n_sub)


def test_select_sub_page_boxes_wide_row():
    """4097 pages of two boxes each, chunked key search."""
    gen = torch.Generator().manual_seed(11)
    q, kmin, kmax, table, num = _case([4097, 54], 6, 2, 32, 4097, gen, "normal", 2)
    got = select_pages(q, kmin, kmax, table, num, None, 64, 1, 2, num_splits=4, n_sub=2)
    _check(got, q, kmin, kmax, table, num, 64, 1, 2, 1e-3, n_sub=2)


def test_sub_page_boxes_find_the_page_a_whole_page_box_misses():
    """A constructed case. The query is all ones (every head of the group). Page 5 holds the
    source: 8 keys equal to ``ones`` (logit 16); its other keys are 0. Pages 7..14 are
    distractors: token t is ``1.5 * e_(t mod 16)`` (true logit 1.5), so every channel of
    their whole-page box reaches 1.5 and the box bounds their logit by 24 > 16 — the
    whole-page box ranks them above page 5. An 8-token box of a distractor spans 8 channels
    (bound 12), page 5's source box is tight (16): 8-token boxes select page 5 (Quest and
    ArkVale, engine select path: the fused kernel on CUDA, the reference on CPU)."""
    D, ps, W = 16, 32, 20
    gen = torch.Generator().manual_seed(0)
    k = torch.rand(W + 1, ps, D, generator=gen) * 1e-3  # background: ~0 (no exact ties)
    k[5, 8:16] = 1.0
    for p in range(7, 15):
        k[p] = 1.5 * torch.eye(D).repeat(ps // D, 1) + k[p]
    q = torch.ones(1, 3, D)
    table = torch.arange(W, dtype=torch.int32).view(1, 1, W)
    num = torch.tensor([[W]], dtype=torch.int32)
    last = torch.tensor([ps], dtype=torch.int32)
    true = torch.einsum("d,wtd->wt", q[0, 0], k[:W]).amax(-1)
    assert int(true[1:W - 1].argmax()) + 1 == 5  # page 5 holds the best key
    picked = {}
    for name in ("quest", "arkvale", "quest-b8", "arkvale-b8"):
        alg = get_algorithm_class(name)(ps, 3, 1, 1)  # sink + one scored page + the last
        summ = alg.make_summaries(W + 1, D)
        alg.index(k, torch.arange(W, dtype=torch.int32), torch.full((W,), ps, dtype=torch.int32),
                  summ, None)
        dev = LayerSummaries({n: t.to(DEVICE) for n, t in summ.tensors.items()}, summ.shapes)
        sel = alg.select(*to_dev(q, table, num, last), dev, None)
        picked[name] = sorted(sel.blocks[0, 0].tolist())[1]
    assert picked["quest"] in range(7, 15) and picked["arkvale"] in range(7, 15), picked
    assert picked["quest-b8"] == 5 and picked["arkvale-b8"] == 5, picked


def test_ties_take_lowest_blocks_and_small_budgets():
    """All-equal scores: the lowest non-kept blocks fill the budget; budget 1 and 2 and W
    below the budget give the reference's widths (K = max(1, min(budget - 1, W)) + 1)."""
    gen = torch.Generator().manual_seed(3)
    q, kmin, kmax, table, num = _case([40, 9], 4, 2, 16, 41, gen, "normal")
    q.zero_()
    pages, nsel, blocks = select_pages(q, kmin, kmax, table, num, None, 8, 1, 2)
    assert blocks[0, 0, :8].tolist() == [0, 1, 2, 3, 4, 5, 38, 39]
    assert blocks.device.type == DEVICE.type
    for budget in (1, 2, 3, 64):
        got = select_pages(q, kmin, kmax, table, num, None, budget, 1, 2)
        want_k = max(1, min(budget - 1, 41)) + 1
        assert got[0].shape[2] == want_k
        _check(got, q, kmin, kmax, table, num, budget, 1, 2, 1e-6)
    # more kept pages than the budget holds: the lowest kept blocks, then the last page
    got = select_pages(q, kmin, kmax, table, num, None, 4, 3, 4)
    assert got[2][0, 0].tolist() == [0, 1, 2, 39]


def test_out_buffers_and_dispatch():
    gen = torch.Generator().manual_seed(5)
    q, kmin, kmax, table, num = _case([30, 17], 8, 2, 32, 33, gen, "normal")
    outs = to_dev(torch.full((2, 2, 8), -7, dtype=torch.int32),
                  torch.zeros(2, 2, dtype=torch.int32), torch.full((2, 2, 8), -7, dtype=torch.int64))
    res = select_pages(q, kmin, kmax, table, num, None, 8, 1, 2, *outs)
    assert all(r.data_ptr() == o.data_ptr() for r, o in zip(res, outs))
    _check(res, q, kmin, kmax, table, num, 8, 1, 2, 1e-3)
    for backend in ("torch", "triton"):
        got = dispatch_select(*to_dev(q, kmin, kmax, table, num), None, 8, 1, 2,
                              backend=backend)
        _check(got, q, kmin, kmax, table, num, 8, 1, 2, 1e-3, block_order=backend == "triton")
        assert torch.equal(got[1], res[1])
        assert torch.equal(got[2].sort(-1).values, res[2].sort(-1).values)


@pytest.mark.parametrize("algo", ["quest", "arkvale", "quest-b8", "arkvale-b8"])
def test_algorithm_select_equals_generic_select(algo, monkeypatch):
    """On DEVICE: Quest/ArkVale.select (fused path: the kernel on CUDA, the reference on CPU)
    and the kernel itself pick the same pages as SparseAlgorithm.select; fused_select = False
    is the generic path itself."""
    torch.manual_seed(0)
    B, hkv, G, D, ps, W = 3, 2, 2, 16, 16, 40
    alg = get_algorithm_class(algo)(ps, 8, 1, 2)
    P = B * W * hkv + 1
    k_cache = torch.randn(P, ps, D, device=DEVICE)
    summ = alg.make_summaries(P, D, device=DEVICE)
    table = torch.randperm(P - 1)[:B * hkv * W].view(B, hkv, W).int().to(DEVICE)
    alg.index(k_cache, table.reshape(-1),
              torch.full((B * hkv * W,), ps, dtype=torch.int32, device=DEVICE), summ, None)
    n = to_dev(torch.tensor([1, 7, 37], dtype=torch.int32)[:, None].expand(B, hkv).contiguous())
    last = torch.tensor([5, 16, 9], dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, hkv * G, D).to(DEVICE)
    want = SparseAlgorithm.select(alg, q, table, n, last, summ, k_cache)
    got = alg.select(q, table, n, last, summ, None)
    p, ns, bl = select_pages(q, summ["kmin"], summ["kmax"], table, n, last, 8, 1, 2,
                             n_sub=alg.n_sub)
    assert torch.equal(ns, want.num_pages)
    assert torch.equal(got.num_pages, want.num_pages) and got.last_page_len is not None
    for b in range(B):
        for h in range(hkv):
            m = int(want.num_pages[b, h])
            want_set = set(want.blocks[b, h, :m].tolist())
            assert set(bl[b, h, :m].tolist()) == want_set
            assert set(got.blocks[b, h, :m].tolist()) == want_set
            assert int(got.blocks[b, h, m - 1]) == int(n[b, h]) - 1
            assert got.page_table[b, h, :m].tolist() == table[b, h, got.blocks[b, h, :m]].tolist()
    monkeypatch.setattr(type(alg), "fused_select", False)
    plain = alg.select(q, table, n, last, summ, k_cache)
    assert torch.equal(plain.blocks, want.blocks) and torch.equal(plain.page_table,
                                                                   want.page_table)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_select_half_dtypes(dtype, splits):
    """fp16 / bf16 queries and summaries select the pages the fp32 masses of the same rounded
    values select (interpreted: bf16 in fp32, the interpreter's bf16 dot is wrong)."""
    gen = torch.Generator().manual_seed(6)
    q, kmin, kmax, table, num = _case([97, 1, 54], 6, 2, 32, 100, gen, "normal")
    half = [t.to(dtype) for t in (q, kmin, kmax)]
    got = select_pages(*half, table, num, None, 16, 1, 2, num_splits=splits)
    _check(got, *[t.float() for t in half], table, num, 16, 1, 2, 1e-3)


@pytest.mark.gpu_only("Llama-3-8B head shapes at W 4096 and 9000: too slow in the interpreter")
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_select_bf16_llama_shapes(splits):
    """Llama-3-8B head shapes in bf16 at 128k (W 4096) and beyond MAX_TILE (W 9000)."""
    gen = torch.Generator().manual_seed(6)
    for W, npg in ((4096, [4096, 1, 2000, 4095]), (9000, [9000, 8192])):
        q, kmin, kmax, table, num = _case(npg, 32, 8, 128, W, gen, "normal")
        bf = [t.to(torch.bfloat16) for t in (q, kmin, kmax)]
        got = select_pages(*bf, table, num, None, 64, 1, 2, num_splits=splits)
        _check(got, *[t.float() for t in bf], table, num, 64, 1, 2, 1e-3)


def test_mass_scoring_is_not_drowned_by_flat_heads():
    """One head singles out page 5 (bound +40); the group's two other heads have +24 bounds
    spread over pages 7..14. Summed raw bounds rank pages 7..14 first (48 > 40); by estimated
    attention mass page 5 holds ~1 (all of head 0) and each of 7..14 ~0.25, so mass scoring
    (kernel, reference and Quest's generic score) keeps page 5 and the raw-sum variant not."""
    from sparseserve.bench.fidelity_variants import QuestSum

    D, W = 16, 20
    q = torch.zeros(1, 3, D)
    q[0, torch.arange(3), torch.arange(3)] = 1.0  # head g reads channel g of the box's top
    kmax = torch.zeros(W + 1, D)
    kmax[5, 0] = 40.0
    kmax[7:15, 1:3] = 24.0
    kmin = kmax - 1.0
    table = torch.arange(W, dtype=torch.int32).view(1, 1, W)
    num = torch.tensor([[W]], dtype=torch.int32)
    budget, sink, local = 3, 1, 1  # sink page 0 + one scored page + the last page
    want = [0, 5, W - 1]
    got = select_pages(q, kmin, kmax, table, num, None, budget, sink, local)
    assert got[2][0, 0].tolist() == want
    assert sorted(ref.select_pages(q, kmin, kmax, table, num, None, budget, sink,
                                   local)[2][0, 0].tolist()) == want
    q, kmin, kmax, table, num = to_dev(q, kmin, kmax, table, num)
    summ = LayerSummaries({"kmin": kmin, "kmax": kmax})
    last = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    for cls in (get_algorithm_class("quest"), QuestSum):
        alg = cls(16, budget, sink, local)
        alg.fused_select = False
        sel = alg.select(q, table, num, last, summ, None)
        picked = sorted(sel.blocks[0, 0].tolist())
        if cls is QuestSum:
            assert picked[1] in range(7, 15)
        else:
            assert picked == want


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 32), (4, 4, 16), (4, 2, 48)])
def test_select_with_key_codes_matches_reference(bits, Hq, Hkv, D):
    """Token key codes through the fused kernel (``codes=``, ``bits=``): the kernel's pages are
    the reference's (ref.select_pages with codes = mass_from_bounds(code_page_bounds)) at
    1, 2, 3, 17, 54, 97 pages, fused and split launches; KeyCodes.select == generic select."""
    gen = torch.Generator().manual_seed(bits * 5 + Hq)
    ps = 16
    B, W = len(NPAGES), 100
    P = B * Hkv * W
    alg = get_algorithm_class(f"keycode{bits}")(ps, 8, 1, 2)
    summ = alg.make_summaries(P + 1, D)
    k = torch.randn(P, ps, D, generator=gen)
    alg.index(k, torch.arange(P, dtype=torch.int32), torch.full((P,), ps, dtype=torch.int32),
              summ, None)
    q, _, _, table, num = _case(NPAGES, Hq, Hkv, D, W, gen, "normal")
    table = torch.where(table >= P, 0, table)  # garbage ids past num_pages stay in range
    kmin, kmax, codes = summ["kmin"], summ["kmax"], summ["codes"]
    for budget, sink, local, splits in ((8, 1, 2, 1), (16, 0, 1, 3)):
        got = select_pages(*to_dev(q, kmin, kmax, table, num), None, budget, sink, local,
                           num_splits=splits, codes=to_dev(codes), bits=bits)
        rp, rn, rb = ref.select_pages(*to_dev(q, kmin, kmax, table, num), None, budget, sink,
                                      local, codes=to_dev(codes), bits=bits)
        assert torch.equal(got[1].cpu(), rn.cpu())
        for b in range(B):
            for h in range(Hkv):
                m = int(rn[b, h])
                assert set(got[2][b, h, :m].tolist()) == set(rb[b, h, :m].tolist())
    alg2 = get_algorithm_class(f"keycode{bits}")(ps, 8, 1, 2)
    last = torch.full((B,), 3, dtype=torch.int32)
    dev = LayerSummaries({n: t.to(DEVICE) for n, t in summ.tensors.items()}, summ.shapes)
    fused = alg2.select(*to_dev(q, table, num, last), dev, None)
    alg2.fused_select = False
    plain = alg2.select(*to_dev(q, table, num, last), dev, None)
    assert torch.equal(fused.num_pages, plain.num_pages)
    for b in range(B):
        for h in range(Hkv):
            m = int(plain.num_pages[b, h])
            assert set(fused.blocks[b, h, :m].tolist()) == set(plain.blocks[b, h, :m].tolist())
