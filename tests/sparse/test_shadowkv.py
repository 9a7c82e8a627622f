"""shadowkv (sparse/shadowkv.py): landmark softmax scores against a straightforward torch
computation, outlier pages kept, dense at a full budget, forced offload == all resident, and
no state kept between calls."""
import math
import random

import pytest
import torch

import sparseserve.sparse.shadowkv  # noqa: F401  (registers "shadowkv" before sparse/__init__ does)
from sparseserve import LLM, SamplingParams
from sparseserve.sparse import get_algorithm_class
from sparseserve.sparse.shadowkv import ShadowKV
from tests.kvcache.test_offload_engine import check_forced_offload_equals_resident
from tests.sparse.test_algorithm_state import tensors_of

LENGTHS = [1, 17, 54, 97]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


# ---- the explicit reference ------------------------------------------------------------------
def ref_index(k_cache, page, ntok, chunk=8):
    """Per chunk of one page: (landmark [D] = mean of its valid keys, 2 - min cos) or None."""
    out = []
    for j in range(k_cache.shape[1] // chunk):
        keys = k_cache[page, j * chunk:min((j + 1) * chunk, ntok)].double()
        if keys.shape[0] == 0:
            out.append(None)
            continue
        lm = keys.mean(0)
        cos = min(float(k @ lm / (k.norm() * lm.norm())) for k in keys)
        out.append((lm, 2.0 - cos))
    return out


def ref_scores(q, page_table, num_pages, chunks_of, sink, local, budget, reduce="max",
               fraction=0.0, share=0.25):
    """Straightforward per (request, KV head) loops: softmax over every chunk landmark of the
    full pages, per page max (or sum) over its chunks, max over the group; outlier pages."""
    B, hq, D = q.shape
    hkv, W = page_table.shape[1:]
    G = hq // hkv
    out = torch.full((B, hkv, W), float("-inf"), dtype=torch.float64)
    cap = math.floor(share * max(0, budget - sink - local))
    for b in range(B):
        for h in range(hkv):
            n = int(num_pages[b, h])
            lms = [(w, lm) for w in range(n - 1)
                   for c in chunks_of[int(page_table[b, h, w])] if c is not None
                   for lm in [c[0]]]
            page = torch.zeros(W, dtype=torch.float64)
            for g in range(G):
                qg = q[b, h * G + g].double()
                logits = torch.stack([qg @ lm for _, lm in lms]) * D ** -0.5 if lms else None
                probs = torch.softmax(logits, 0) if lms else None
                for w in range(n - 1):
                    ps = [float(probs[i]) for i, (ww, _) in enumerate(lms) if ww == w]
                    v = (max(ps) if reduce == "max" else sum(ps)) if ps else 0.0
                    page[w] = max(page[w], v)
            scored = [w for w in range(sink, n - local) if w < n - 1
                      and any(c is not None for c in chunks_of[int(page_table[b, h, w])])]
            worst = {w: max(c[1] for c in chunks_of[int(page_table[b, h, w])] if c is not None)
                     for w in scored}
            n_out = min(math.ceil(fraction * len(scored)), cap) if fraction > 0 and cap > 0 else 0
            for w in sorted(scored, key=lambda w: -worst[w])[:n_out]:
                page[w] = 1.0 + worst[w]
            out[b, h, :n] = page[:n]
    return out


def _case(G, hkv, seed, ps=32, D=16):
    """Requests of 1, 17, 54, 97 pages (pages shuffled over the cache), every full page
    indexed, each row's partial last page indexed with its few tokens, a spare zero row."""
    g = torch.Generator().manual_seed(seed)
    B, W = len(LENGTHS), max(LENGTHS)
    P = B * hkv * W + 2
    k_cache = torch.randn(P, ps, D, generator=g) + 0.7 * torch.randn(P, 1, D, generator=g)
    page_table = torch.randperm(P - 2, generator=g)[:B * hkv * W].view(B, hkv, W).int()
    num_pages = torch.tensor(LENGTHS, dtype=torch.int32)[:, None].expand(B, hkv).contiguous()
    last_len = torch.tensor([5, 17, 32, 9], dtype=torch.int32)
    ids, ntok = [], []
    for b in range(B):
        for h in range(hkv):
            for w in range(LENGTHS[b]):
                ids.append(int(page_table[b, h, w]))
                ntok.append(int(last_len[b]) if w == LENGTHS[b] - 1 else ps)
    q = torch.randn(B, hkv * G, D, generator=g) * 2.0
    return k_cache, page_table, num_pages, last_len, torch.tensor(ids, dtype=torch.int32), \
        torch.tensor(ntok, dtype=torch.int32), q


@pytest.mark.parametrize("G,hkv", [(4, 2), (1, 3)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_index_and_score_match_explicit_landmark_softmax(G, hkv, reduce):
    k_cache, page_table, num_pages, last_len, ids, ntok, q = _case(G, hkv, seed=G * 10 + hkv)
    sink, local, budget = 1, 2, 40
    algo = ShadowKV(32, budget, sink, local)
    algo.page_reduce = reduce
    S = k_cache.shape[0] + 1
    summ = algo.make_summaries(S, k_cache.shape[2])
    # masked lanes mixed in: they must write only the scratch row
    lanes = torch.cat([ids, torch.full((3,), -1, dtype=torch.int32)])
    algo.index(k_cache, lanes, torch.cat([ntok, torch.full((3,), 32, dtype=torch.int32)]), summ,
               None)
    chunks_of = {}
    lm, gap = summ.view("landmarks"), summ.view("cosgap")
    for p, n in zip(ids.tolist(), ntok.tolist()):
        chunks_of[p] = ref_index(k_cache, p, n)
        for j, c in enumerate(chunks_of[p]):
            if c is None:
                assert gap[p, j] == 0 and lm[p, j].abs().max() == 0
            else:
                torch.testing.assert_close(lm[p, j].double(), c[0], atol=1e-5, rtol=1e-5)
                assert float(gap[p, j]) == pytest.approx(c[1], abs=1e-5)
    for p in range(S - 1):  # pages never listed stay zero rows
        if p not in chunks_of:
            assert gap[p].abs().max() == 0
            chunks_of[p] = [None] * algo.n_chunks
    for fraction in (0.0, 0.1):
        algo.outlier_fraction = fraction
        got = algo.score(q, page_table, num_pages, last_len, summ, None)
        ref = ref_scores(q, page_table, num_pages, chunks_of, sink, local, budget, reduce,
                         fraction)
        n = num_pages[:, :, None].long()
        blk = torch.arange(page_table.shape[2]).view(1, 1, -1)
        assert bool((got[blk >= n] == float("-inf")).all())
        full = blk < n - 1  # the partial last page is forced by select: its score is unused
        torch.testing.assert_close(got[full].double(), ref[full], atol=1e-5, rtol=1e-4)
        assert bool(torch.isfinite(got[blk < n]).all())
        if fraction:  # outliers exist (97 pages: ceil(0.1 * 94) = 10 > cap 9) and are capped
            out = (got >= 2).sum(-1)
            assert int(out.max()) == algo.outlier_cap == 9
    # the selection is the shared one: kept pages, the last page last, the budget exact
    sel = algo.select(q, page_table, num_pages, last_len, summ, None)
    assert sel.num_pages.tolist() == [[min(n, budget)] * hkv for n in LENGTHS]


def test_stale_and_empty_chunks_never_win():
    """A full page whose row was never indexed (zeros: q · 0 = 0 beats negative logits) and the
    empty chunks of a partial page score nothing; a partial page scores its valid chunk."""
    torch.manual_seed(0)
    D, ps = 16, 32
    algo = ShadowKV(ps, 4, 1, 1)
    algo.outlier_fraction = 0.0
    base = torch.randn(D)
    k_cache = base + 0.05 * torch.randn(12, ps, D)  # every key close to base
    summ = algo.make_summaries(13, D)
    ids = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8], dtype=torch.int32)  # page 3: never indexed
    ntok = torch.full((8,), ps, dtype=torch.int32)
    ntok[4] = 5  # page 5 holds 5 tokens: chunk 0 only
    algo.index(k_cache, ids, ntok, summ, None)
    assert summ.view("cosgap")[5, 1:].abs().max() == 0 and summ.view("cosgap")[5, 0] > 0
    q = (-base * 3).view(1, 1, D)  # every real logit negative
    pt = torch.arange(10, dtype=torch.int32).view(1, 1, 10)
    num = torch.tensor([[10]], dtype=torch.int32)
    s = algo.score(q, pt, num, torch.tensor([3], dtype=torch.int32), summ, None)[0, 0]
    assert s[3] == 0 and bool((s[[1, 2, 4, 6, 7, 8]] > 0).all())
    x = (summ.view("landmarks")[:9].float() @ q[0, 0]) * D ** -0.5  # [9, C]
    real = torch.tensor([0, 1, 2, 4, 6, 7, 8])
    lse = torch.logsumexp(torch.cat([x[real].reshape(-1), x[5, :1]]), 0)
    assert float(s[5]) == pytest.approx(float(torch.exp(x[5, 0] - lse)), rel=1e-5)
    sel = algo.select(q, pt, num, torch.tensor([3], dtype=torch.int32), summ, None)
    assert 3 not in sel.blocks[0, 0, :int(sel.num_pages[0, 0])].tolist()


def test_outlier_chunk_page_selected_though_its_landmark_scores_low():
    """Keys of one chunk alternate +-u around a mean orthogonal to q: its landmark (the mean)
    scores q · mean = 0, far below the other pages' landmarks, yet half its keys carry the
    largest true logits. The outlier rule keeps its page; landmark scores alone do not."""
    torch.manual_seed(1)
    D, ps, n = 16, 32, 40
    q = torch.zeros(1, 4, D)
    q[0, :, 0] = 4.0  # the group's heads all point along e0
    k_cache = torch.randn(n + 1, ps, D) * 0.02
    k_cache[:, :, 1] += 1.0
    k_cache[:, :, 0] += 0.3 * torch.rand(n + 1, 1)  # mean logits 0..1.2 / sqrt(D)
    target = 17
    k_cache[target, :, 0] = 0.02 * torch.randn(ps)  # its landmarks point nowhere along q
    k_cache[target, 8:16] = 0.0
    k_cache[target, 8:16, 1] = 1.0
    k_cache[target, 8:16, 0] = torch.tensor([3.0, -3.0] * 4)  # mean 0 along q; max logit 12
    pt = torch.arange(n, dtype=torch.int32).view(1, 1, n)
    num = torch.tensor([[n]], dtype=torch.int32)
    last = torch.tensor([ps], dtype=torch.int32)
    ids = torch.arange(n - 1, dtype=torch.int32)
    picked = {}
    for name, frac in (("shadowkv", 0.02), ("landmarks only", 0.0)):
        algo = ShadowKV(ps, 8, 1, 2)  # 8 pages: 1 sink, 2 local, 5 scored (cap 1 outlier)
        algo.outlier_fraction = frac
        summ = algo.make_summaries(n + 2, D)
        algo.index(k_cache, ids, torch.full_like(ids, ps), summ, None)
        s = algo.score(q, pt, num, last, summ, None)[0, 0]
        sel = algo.select(q, pt, num, last, summ, None)
        picked[name] = sel.blocks[0, 0, :int(sel.num_pages[0, 0])].tolist()
        if not frac:  # the landmark score of the page is among the lowest
            assert int((s[1:n - 2] < s[target]).sum()) <= 3
            gap = summ.view("cosgap")[target]
            assert float(gap[1]) > 1.5 and float(gap[1]) == float(summ.view("cosgap")[:n - 1].max())
    assert target in picked["shadowkv"]
    assert target not in picked["landmarks only"]
    oracle = get_algorithm_class("oracle")(ps, 8, 1, 2)
    sel = oracle.select(q, pt, num, last, None, k_cache)
    assert target in sel.blocks[0, 0, :int(sel.num_pages[0, 0])].tolist()


def test_bf16_summaries():
    """In the KV dtype bf16 the chunk markers survive (0 = no keys, [1, 3] otherwise)."""
    torch.manual_seed(2)
    algo = ShadowKV(32, 8, 1, 2)
    k = torch.randn(6, 32, 64, dtype=torch.bfloat16)
    summ = algo.make_summaries(7, 64, dtype=torch.bfloat16)
    algo.index(k, torch.tensor([0, 1, 2, -1], dtype=torch.int32),
               torch.tensor([32, 32, 9, 32], dtype=torch.int32), summ, None)
    gap = summ.view("cosgap").float()
    assert bool(((gap[:2] >= 1) & (gap[:2] <= 3)).all())
    assert gap[2, :2].min() >= 1 and gap[2, 2:].abs().max() == 0 and gap[3:6].abs().max() == 0
    q = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    s = algo.score(q, torch.tensor([[[0, 1, 2, 3]]], dtype=torch.int32),
                   torch.tensor([[4]], dtype=torch.int32), torch.tensor([5]), summ, None)
    assert s.dtype == torch.float32 and bool(torch.isfinite(s).all())


def test_select_invariants():
    from tests.sparse import test_sparse_engine
    test_sparse_engine.test_select_keeps_sink_local_last_and_respects_budget("shadowkv")


# ---- in the engine --------------------------------------------------------------------------
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


def prompts():
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in LENGTHS]


@pytest.mark.parametrize("page_size", [16, 32])
def test_full_budget_equals_dense(model_dir, page_size):
    dense = LLM(model_dir, page_size=page_size, max_num_seqs=4).generate(prompts(), PARAMS,
                                                                         use_tqdm=False)
    llm = LLM(model_dir, page_size=page_size, max_num_seqs=4, sparse_algorithm="shadowkv",
              token_budget=512, sink_pages=1, local_pages=1)
    outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    for got, ref in zip(outs, dense):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs):
            for t in b:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    llm.engine.check_invariants()


def test_sparse_budget_differs_from_dense(model_dir):
    """At a 64-token budget the selection really drops pages (the outputs move)."""
    kw = {"page_size": 16, "max_num_seqs": 4}
    dense = LLM(model_dir, **kw).generate(prompts(), PARAMS, use_tqdm=False)
    llm = LLM(model_dir, sparse_algorithm="shadowkv", token_budget=64, sink_pages=1,
              local_pages=1, **kw)
    outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert any(a.outputs[0].logprobs != b.outputs[0].logprobs for a, b in zip(outs, dense))


def test_forced_offload_equals_resident(model_dir):
    check_forced_offload_equals_resident(model_dir, "shadowkv")


def test_stateless_between_calls_of_every_size():
    """index/score at several sizes leave no tensor on the algorithm object (the engine-level
    check under eviction is tests/sparse/test_algorithm_state.py's, over every registered
    algorithm)."""
    algo = ShadowKV(32, 8, 1, 2)
    assert tensors_of(algo) == {}
    for W, N, B in ((5, 3, 1), (40, 17, 3)):
        k = torch.randn(N + 1, 32, 16)
        summ = algo.make_summaries(N + 2, 16)
        algo.index(k, torch.arange(N, dtype=torch.int32), torch.full((N,), 32, dtype=torch.int32),
                   summ, None)
        pt = torch.randint(0, N, (B, 2, W), dtype=torch.int32)
        algo.select(torch.randn(B, 4, 16), pt, torch.full((B, 2), W, dtype=torch.int32),
                    torch.full((B,), 7, dtype=torch.int32), summ, None)
        assert tensors_of(algo) == {}
