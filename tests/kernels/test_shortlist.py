"""Key-code shortlist selection (``kernels.select_pages_shortlist``: two fused selects and a
gather; Triton compiled on CUDA, interpreted on CPU, and the torch backend) against its spec
``ref.select_pages_shortlist`` (both scores of every page, the box top-S, the code top-K
inside), and the spec against an explicit float64 two-stage selection from the decoded
approximate keys: at 1, 17, 54, 97 and 4097 pages, GQA and MHA, batch > 1 with rows of
different lengths, sink / local pages kept, a budget that covers every page, a shortlist that
covers every page (= keycode2)."""
import pytest
import torch

from sparseserve.kernels import ref
from sparseserve.kernels import select_pages_shortlist as select_sl
from sparseserve.sparse import get_algorithm_class
from sparseserve.sparse.base import LayerSummaries, SparseAlgorithm

from tests.conftest import DEVICE
from tests.kernels import to_dev

NPAGES = [1, 17, 54, 97]


def _case(npages, Hq, Hkv, D, ps, gen, budget=8, sink=1, local=2, algo="keycode2-sl2",
          peaked=False):
    """An indexed keycode2 shortlist algorithm and q, summaries, page table (distinct random
    pages, garbage-but-valid ids past num_pages), num_pages (the last head of each request one
    page fewer, to vary rows), last_page_len."""
    B, W = len(npages), max(npages)
    P = B * Hkv * W
    alg = get_algorithm_class(algo)(ps, budget, sink, local)
    summ = alg.make_summaries(P + 1, D)
    k = torch.randn(P, ps, D, generator=gen)
    alg.index(k, torch.arange(P, dtype=torch.int32), torch.full((P,), ps, dtype=torch.int32),
              summ, None)
    q = torch.randn(B, Hq, D, generator=gen) * (8.0 if peaked else 1.0)
    table = torch.randperm(P, generator=gen).view(B, Hkv, W).to(torch.int32)
    num = torch.tensor(npages, dtype=torch.int32).view(B, 1).repeat(1, Hkv)
    if Hkv > 1:
        num[:, -1] = (num[:, -1] - 1).clamp(min=1)
    last = torch.randint(1, ps + 1, (B,), generator=gen, dtype=torch.int32)
    return alg, summ, q, table, num, last


def _args(alg, summ, q, table, num, last):
    return (q, summ["kmin"], summ["kmax"], summ["codes"], table, num, last, alg.budget_pages,
            alg.shortlist_pages, alg.sink_pages, alg.local_pages, alg.bits)


def _check(got, want, table, num, sink, local, tail=True):
    """Same num_sel and the same set per row; the selection's structure (kept pages in, the
    last page at num_sel - 1 and, with ``tail``, repeated after it (the fused selects'
    contract; the base class's generic select leaves other entries there), physical ids =
    the table's)."""
    pages, nsel, blocks = (t.cpu() for t in got)
    wp, wn, wb = (t.cpu() for t in want)
    assert pages.shape == wp.shape and blocks.shape == wb.shape
    assert pages.dtype == torch.int32 and nsel.dtype == torch.int32 and blocks.dtype == torch.int64
    assert torch.equal(nsel, wn)
    table, num = table.cpu(), num.cpu()
    B, Hkv, _ = table.shape
    K = pages.shape[2]
    for b in range(B):
        for h in range(Hkv):
            n, m = int(num[b, h]), int(nsel[b, h])
            blk = blocks[b, h].tolist()
            assert m == min(K, n) and blk[m - 1] == n - 1
            if tail:
                assert blk[m:] == [n - 1] * (K - m)
            assert pages[b, h].tolist() == table[b, h, blk].tolist()
            assert len(set(blk[:m])) == m
            kept = set(range(min(sink, n))) | set(range(max(0, n - local), n))
            if len(kept) <= m:
                assert kept <= set(blk[:m])
            assert set(blk[:m]) == set(wb[b, h, :m].tolist()), (b, h)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("Hq,Hkv,D,ps", [(6, 2, 32, 16), (4, 4, 16, 32), (8, 2, 64, 16)])
@pytest.mark.parametrize("algo,budget,sink,local", [("keycode2-sl2", 8, 1, 2),
                                                    ("keycode2-sl", 4, 0, 1),
                                                    ("keycode2-sl2", 6, 2, 3)])
def test_shortlist_matches_reference(backend, Hq, Hkv, D, ps, algo, budget, sink, local):
    gen = torch.Generator().manual_seed(Hq * 7 + D + ps + budget + sink)
    alg, summ, q, table, num, last = _case(NPAGES, Hq, Hkv, D, ps, gen, budget, sink, local,
                                           algo)
    assert alg.shortlist_pages < table.shape[2]  # the two-stage path
    args = to_dev(*_args(alg, summ, q, table, num, last))
    want = ref.select_pages_shortlist(*args)
    for splits in ((1, 3) if backend == "triton" else (None,)):
        got = select_sl(*args, backend=backend, num_splits=splits)
        assert all(t.device.type == DEVICE.type for t in got)
        _check(got, want, table, num, sink, local)


def test_shortlist_wide_row():
    """4097 pages (stage 1 past one key tile's 4096 entries), a 5-page row beside it."""
    gen = torch.Generator().manual_seed(4097)
    alg, summ, q, table, num, last = _case([4097, 5], 6, 2, 32, 16, gen, 16, 1, 2)
    args = to_dev(*_args(alg, summ, q, table, num, last))
    want = ref.select_pages_shortlist(*args)
    for backend in ("triton", "torch"):
        _check(select_sl(*args, backend=backend), want, table, num, 1, 2)


def test_spec_is_box_shortlist_then_code_top_k():
    """ref.select_pages_shortlist against an explicit float64 two-stage selection: the
    shortlist = kept + last + the best S - 1 - kept pages by the box mass (Quest's bound per
    head on the codes' box, a softmax per head over the full pages, summed over the group),
    the choice = kept + last + the best by the approximate token mass of the decoded keys,
    each head's softmax over the shortlisted full pages."""
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, D, ps, sink, local = 6, 2, 32, 16, 1, 2
    alg, summ, q, table, num, last = _case(NPAGES, Hq, Hkv, D, ps, gen, 8, sink, local)
    _, wn, wb = ref.select_pages_shortlist(*_args(alg, summ, q, table, num, last))
    S, G = alg.shortlist_pages, Hq // Hkv
    kh = alg.approx_keys(summ, table.long()).double()  # [B, Hkv, W, ps, D]
    lo, hi = summ["kmin"][table.long()].double(), summ["kmax"][table.long()].double()
    differs = 0
    for b in range(len(NPAGES)):
        for h in range(Hkv):
            n = int(num[b, h])
            qg = q[b, h * G:(h + 1) * G].double()                       # [G, D]
            full = list(range(n - 1))
            kept = [w for w in full if w < sink or w >= n - local]
            box = (qg.clamp(min=0) @ hi[b, h, :n - 1].T + qg.clamp(max=0) @ lo[b, h, :n - 1].T)
            box_mass = torch.softmax(box * D ** -0.5, -1).sum(0) if full else None
            rest = sorted((w for w in full if w not in kept), key=lambda w: -box_mass[w])
            short = sorted(kept + rest[:max(0, min(S - 1, n - 1) - len(kept))])
            x = torch.einsum("gd,wtd->gwt", qg, kh[b, h, short]) * D ** -0.5
            code_mass = dict(zip(short, torch.softmax(x.flatten(1), -1).view(G, len(short), ps)
                                 .sum((0, 2)).tolist())) if short else {}
            k = min(alg.budget_pages - 1, n - 1)
            rank = sorted((w for w in short if w not in kept), key=lambda w: -code_mass[w])
            want = set(kept + rank[:max(0, k - len(kept))]) | {n - 1}
            m = int(wn[b, h])
            assert set(wb[b, h, :m].tolist()) == want, (b, h)
            # keycode2 (codes of every page) chose differently somewhere: the shortlist matters
            kc = ref.select_pages(q[b:b + 1], summ["kmin"], summ["kmax"], table[b:b + 1],
                                  num[b:b + 1], None, alg.budget_pages, sink, local,
                                  codes=summ["codes"], bits=2)
            differs += set(kc[2][0, h, :m].tolist()) != want
    assert differs > 0


def test_full_budget_and_covering_shortlist():
    """A budget covering every page selects every page (= dense); a shortlist covering the
    row width is keycode2's selection (the fused path then calls keycode2's select)."""
    gen = torch.Generator().manual_seed(5)
    for algo, budget in (("keycode2-sl2", 128), ("keycode2-sl", 32)):
        alg, summ, q, table, num, last = _case(NPAGES, 6, 2, 32, 16, gen, budget, 1, 2, algo)
        args = to_dev(*_args(alg, summ, q, table, num, last))
        assert alg.shortlist_pages >= table.shape[2]
        q_, kmin, kmax, codes, table_, num_ = args[:6]
        want = ref.select_pages(q_, kmin, kmax, table_, num_, None, budget, 1, 2, codes=codes,
                                bits=2)
        for backend in ("triton", "torch"):
            got = select_sl(*args, backend=backend)
            _check(got, want, table, num, 1, 2)
            _check(got, ref.select_pages_shortlist(*args), table, num, 1, 2)
            if budget >= table.shape[2]:
                n = num.to(DEVICE)
                assert torch.equal(got[1], n)  # everything


@pytest.mark.parametrize("algo", ["keycode2-sl", "keycode2-sl2"])
def test_algorithm_select_paths_agree(algo, monkeypatch):
    """On DEVICE: the algorithm's fused select (kernels on CUDA, the reference on CPU), its
    generic path (SparseAlgorithm.select over score(): box kernel, shortlist, code kernel on
    the shortlisted pages only) and the spec pick the same pages; fused_select = False is the
    generic path."""
    gen = torch.Generator().manual_seed(3)
    alg, summ, q, table, num, last = _case(NPAGES, 6, 2, 32, 16, gen, 4, 1, 2, algo)
    dev = LayerSummaries({n: t.to(DEVICE) for n, t in summ.tensors.items()}, summ.shapes)
    q, table, num, last = to_dev(q, table, num, last)
    want = ref.select_pages_shortlist(*_args(alg, dev, q, table, num, last))
    fused = alg.select(q, table, num, last, dev, None)
    generic = SparseAlgorithm.select(alg, q, table, num, last, dev, None)
    for sel in (fused, generic):
        _check((sel.page_table, sel.num_pages, sel.blocks), want, table, num, 1, 2,
               tail=sel is fused)
        assert sel.last_page_len is last
    monkeypatch.setattr(type(alg), "fused_select", False)
    plain = alg.select(q, table, num, last, dev, None)
    assert torch.equal(plain.blocks, generic.blocks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shortlist_half_summaries(dtype):
    """16-bit box rows (codes stay int32): the selection keeps its structure and matches the
    fp32 spec over the same rounded values but for near-ties (on CUDA the code dot runs in the
    summary dtype; interpreted, in fp32)."""
    gen = torch.Generator().manual_seed(6)
    alg, summ, q, table, num, last = _case([97, 1, 54], 6, 2, 32, 16, gen, 8, 1, 2)
    q, kmin, kmax = (t.to(dtype) for t in (q, summ["kmin"], summ["kmax"]))
    args = (q, kmin, kmax, summ["codes"], table, num, last, 8, alg.shortlist_pages, 1, 2, 2)
    got = [t.cpu() for t in select_sl(*to_dev(*args), backend="triton")]
    want = ref.select_pages_shortlist(q.float(), kmin.float(), kmax.float(), *args[3:])
    assert torch.equal(got[1], want[1])
    same = total = 0
    for b in range(3):
        for h in range(2):
            m = int(want[1][b, h])
            assert got[2][b, h, m - 1] == num[b, h] - 1
            same += len(set(got[2][b, h, :m].tolist()) & set(want[2][b, h, :m].tolist()))
            total += m
    assert same >= 0.9 * total
