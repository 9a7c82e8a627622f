"""RetroInfer-style in-page clusters with an estimation zone (sparse/retroinfer.py).

(a) a budget covering every page equals dense, tokens and logprobs, with the estimation zone
    on and off (everything selected: the estimate contributes nothing, lse -inf);
(b) index / score / estimate against explicit per-page, per-head torch loops at odd lengths
    (1, 17, 54, 97), GQA and MHA; the engine's merge against an explicit softmax over the exact
    tokens' and the estimated clusters' logits; tight clusters make the estimate exact;
(c) forced offload == all resident, with the estimate contributing;
(d) the algorithm object holds no tensor after calls of different sizes.
"""
import math

import pytest
import torch

import sparseserve.sparse.retroinfer  # noqa: F401  (registers retroinfer, retroinfer-noest)
from sparseserve import LLM
from sparseserve.kernels import ref
from sparseserve.sparse import get_algorithm_class
from sparseserve.sparse.retroinfer import RetroInfer

from tests.kvcache.test_offload_engine import check_forced_offload_equals_resident
from tests.sparse.test_algorithm_state import tensors_of
from tests.sparse.test_sparse_engine import PARAMS, prompts

LENGTHS = [1, 17, 54, 97]
ALGOS = ["retroinfer", "retroinfer-noest"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


def _spy_estimates(monkeypatch):
    """Record every estimate's lse (the estimation zone's mass)."""
    seen = []
    orig = RetroInfer.estimate

    def spy(self, *args, **kw):
        o, lse = orig(self, *args, **kw)
        seen.append(lse.clone())
        return o, lse

    monkeypatch.setattr(RetroInfer, "estimate", spy)
    return seen


# ---- (a) full budget == dense ---------------------------------------------------------------
@pytest.mark.parametrize("algo", ALGOS)
def test_full_budget_equals_dense_estimate_on_and_off(model_dir, algo, monkeypatch):
    seen = _spy_estimates(monkeypatch)
    dense = LLM(model_dir, page_size=16, max_num_seqs=4).generate(prompts(), PARAMS,
                                                                  use_tqdm=False)
    llm = LLM(model_dir, page_size=16, max_num_seqs=4, sparse_algorithm=algo,
              token_budget=512, sink_pages=1, local_pages=1)
    outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    for got, want in zip(outs, dense):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            for t in b:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    if algo == "retroinfer":  # the zone was evaluated, and empty: it contributed nothing
        assert seen and all(bool(torch.isneginf(lse).all()) for lse in seen)
    else:
        assert not seen


def test_small_budget_estimate_contributes(model_dir, monkeypatch):
    """At a budget below the requests' pages the zone is not empty and changes the output."""
    seen = _spy_estimates(monkeypatch)
    kw = dict(page_size=16, max_num_seqs=4, token_budget=48, sink_pages=1, local_pages=1)
    on = LLM(model_dir, sparse_algorithm="retroinfer", **kw).generate(prompts(), PARAMS,
                                                                      use_tqdm=False)
    off = LLM(model_dir, sparse_algorithm="retroinfer-noest", **kw).generate(
        prompts(), PARAMS, use_tqdm=False)
    assert any(bool(torch.isfinite(lse).any()) for lse in seen)
    assert any(a.outputs[0].logprobs != b.outputs[0].logprobs for a, b in zip(on, off))


# ---- (b) explicit computations --------------------------------------------------------------
def _kmeans_loop(keys, c, iters):
    """Explicit Lloyd's k-means of one page's n keys [n, D] (float64): contiguous-run init,
    nearest non-empty centroid by L2, means. -> (assign list, count [C], centroid [C, D])."""
    n = keys.shape[0]
    assign = [min(t * c // n, c - 1) for t in range(n)]

    def means(assign):
        cnt = torch.zeros(c, dtype=torch.float64)
        cen = torch.zeros(c, keys.shape[1], dtype=torch.float64)
        for t, j in enumerate(assign):
            cnt[j] += 1
            cen[j] += keys[t]
        for j in range(c):
            if cnt[j] > 0:
                cen[j] /= cnt[j]
        return cnt, cen

    cnt, cen = means(assign)
    for _ in range(iters):
        assign = []
        for t in range(n):
            best, bj = math.inf, 0
            for j in range(c):
                if cnt[j] == 0:
                    continue
                dist = float(((keys[t] - cen[j]) ** 2).sum())
                if dist < best:
                    best, bj = dist, j
            assign.append(bj)
        cnt, cen = means(assign)
    return assign, cnt, cen


def _pool(hq, hkv, D=16, ps=16, tight=False, seed=0):
    """Requests of LENGTHS tokens: K/V pages, page tables, every page indexed (the partial
    last page with its valid tokens). tight: each cluster's keys equal (4 runs per page)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    W = max(-(-n // ps) for n in LENGTHS)
    P = B * hkv * W + 1
    k = torch.randn(P, ps, D, generator=gen)
    if tight:  # 4 runs of equal keys per page: the in-page k-means recovers them exactly
        k = torch.randn(P, 4, 1, D, generator=gen).expand(P, 4, ps // 4, D).reshape(P, ps, D)
        k = k * 2.0
    v = torch.randn(P, ps, D, generator=gen)
    table = torch.randperm(P - 1, generator=gen)[:B * hkv * W].view(B, hkv, W).to(torch.int32)
    npg = torch.tensor([-(-n // ps) for n in LENGTHS], dtype=torch.int32)
    num = npg[:, None].expand(B, hkv).contiguous()
    last = torch.tensor([n - (-(-n // ps) - 1) * ps for n in LENGTHS], dtype=torch.int32)
    q = torch.randn(B, hq, D, generator=gen)
    return k, v, table, num, last, q


def _indexed(algo, k, v, table, num, last, ps):
    P, _, D = k.shape
    summ = algo.make_summaries(P + 1, D)
    ids, ntok = [], []
    for b in range(table.shape[0]):
        n = int(num[b, 0])
        for h in range(table.shape[1]):
            for w in range(n):
                ids.append(int(table[b, h, w]))
                ntok.append(ps if w < n - 1 else int(last[b]))
    ids = torch.tensor(ids + [-1, -1], dtype=torch.int32)  # two masked lanes
    ntok = torch.tensor(ntok + [ps, ps], dtype=torch.int32)
    algo.index(k, ids, ntok, summ, None, v_cache=v)
    return summ, ids, ntok


@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("zone_factor", [1, None])
def test_index_score_estimate_match_explicit_loops(heads, zone_factor):
    hq, hkv = heads
    ps, D, budget, sink, local = 16, 16, 3, 1, 1
    k, v, table, num, last, q = _pool(hq, hkv, D, ps)
    algo = get_algorithm_class("retroinfer")(ps, budget, sink, local)
    algo.zone_factor = zone_factor
    C = algo.n_clusters
    summ, ids, ntok = _indexed(algo, k, v, table, num, last, ps)
    cent, vmean, count = summ.view("cent"), summ.view("vmean"), summ.view("count")
    # index: every listed page's clusters, by an explicit loop
    for p, n in zip(ids.tolist(), ntok.tolist()):
        if p < 0:
            continue
        assign, cnt, cen = _kmeans_loop(k[p, :n].double(), C, algo.kmeans_iters)
        torch.testing.assert_close(count[p].double(), cnt)
        torch.testing.assert_close(cent[p].double(), cen, rtol=1e-5, atol=1e-5)
        vm = torch.zeros(C, D, dtype=torch.float64)
        for t, j in enumerate(assign):
            vm[j] += v[p, t].double() / cnt[j]
        torch.testing.assert_close(vmean[p].double(), vm, rtol=1e-5, atol=1e-5)
    # score: per head a softmax over the full pages of log sum_j n_j exp(s q.c_j), summed over
    # the group; kept pages / the last page +inf, -inf past num_pages
    B, W = table.shape[0], table.shape[2]
    G, scale = hq // hkv, D ** -0.5
    scores = algo.score(q, table, num, last, summ, k)

    def page_lse(b, h, g, w):
        p = int(table[b, h, w])
        terms = [scale * float(q[b, h * G + g].double() @ cent[p, j].double())
                 + math.log(float(count[p, j])) for j in range(C) if count[p, j] > 0]
        return torch.logsumexp(torch.tensor(terms, dtype=torch.float64), 0)

    want = torch.full((B, hkv, W), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(num[b, 0])
        for h in range(hkv):
            for w in range(n):
                kept = w < sink or w >= n - local
                if kept:
                    want[b, h, w] = float("inf")
                    continue
                want[b, h, w] = sum(float(torch.exp(page_lse(b, h, g, w) - torch.logsumexp(
                    torch.stack([page_lse(b, h, g, x) for x in range(n - 1)]), 0)))
                    for g in range(G))
    torch.testing.assert_close(scores.double(), want, rtol=1e-5, atol=1e-6)
    # estimate: the zone (unselected full pages; the next zone_factor * budget by score) ...
    sel = algo.select(q, table, num, last, summ, k)
    o_est, lse_est = algo.estimate(q, sel, table, num, summ, scale)
    o_sel = ref.paged_decode_attention(q, k, v, sel.page_table, sel.num_pages, last, scale)
    lse_sel = ref.paged_decode_lse(q, k, sel.page_table, sel.num_pages, last, scale)
    merged = ref.merge_attention(o_sel, lse_sel, o_est, lse_est)
    for b in range(B):
        n = int(num[b, 0])
        for h in range(hkv):
            chosen = set(sel.blocks[b, h, :int(sel.num_pages[b, h])].tolist())
            cand = [w for w in range(n - 1) if w not in chosen]
            if zone_factor is not None:
                cand = sorted(cand, key=lambda w: -float(scores[b, h, w]))
                cand = cand[:zone_factor * budget]
            for g in range(G):
                hd = h * G + g
                qd = q[b, hd].double()
                # ... each cluster n_j tokens at c_j with value vmean_j
                logits, values = [], []
                for w in cand:
                    p = int(table[b, h, w])
                    for j in range(C):
                        if count[p, j] > 0:
                            logits.append(scale * float(qd @ cent[p, j].double())
                                          + math.log(float(count[p, j])))
                            values.append(vmean[p, j].double())
                if not logits:
                    assert torch.isneginf(lse_est[b, hd])
                    assert torch.equal(merged[b, hd], o_sel[b, hd])
                    continue
                lt = torch.tensor(logits, dtype=torch.float64)
                torch.testing.assert_close(lse_est[b, hd].double(), torch.logsumexp(lt, 0),
                                           rtol=1e-5, atol=1e-5)
                vt = torch.stack(values)
                torch.testing.assert_close(o_est[b, hd].double(),
                                           torch.softmax(lt, 0) @ vt, rtol=1e-5, atol=1e-5)
                # the merge = one softmax over the exact tokens' and the clusters' logits
                ex_l, ex_v = [], []
                for e, w in enumerate(sel.blocks[b, h, :int(sel.num_pages[b, h])].tolist()):
                    p = int(table[b, h, w])
                    nt = int(last[b]) if w == n - 1 else ps
                    ex_l.append(scale * (k[p, :nt].double() @ qd))
                    ex_v.append(v[p, :nt].double())
                all_l = torch.cat(ex_l + [lt])
                all_v = torch.cat(ex_v + [vt])
                torch.testing.assert_close(merged[b, hd].double(),
                                           torch.softmax(all_l, 0) @ all_v,
                                           rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_tight_clusters_make_the_estimate_exact(heads):
    """Keys equal within each cluster: the zone's estimate is the exact attention over the
    zone, so exact + estimate over everything unselected == dense attention over all pages."""
    hq, hkv = heads
    ps, D = 16, 16
    k, v, table, num, last, q = _pool(hq, hkv, D, ps, tight=True, seed=1)
    algo = get_algorithm_class("retroinfer")(ps, 3, 1, 1)
    algo.zone_factor = None
    summ, _, _ = _indexed(algo, k, v, table, num, last, ps)
    scale = D ** -0.5
    sel = algo.select(q, table, num, last, summ, k)
    o_est, lse_est = algo.estimate(q, sel, table, num, summ, scale)
    o_sel = ref.paged_decode_attention(q, k, v, sel.page_table, sel.num_pages, last, scale)
    lse_sel = ref.paged_decode_lse(q, k, sel.page_table, sel.num_pages, last, scale)
    got = ref.merge_attention(o_sel, lse_sel, o_est, lse_est)
    dense = ref.paged_decode_attention(q, k, v, table, num, last, scale)
    assert torch.isfinite(lse_est[2:]).all()  # the long requests had pages to estimate
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(o_sel[2:], dense[2:], atol=1e-3)  # exact part alone is not


# ---- (c) forced offload == resident ---------------------------------------------------------
@pytest.mark.parametrize("algo", ALGOS)
def test_forced_offload_equals_resident(model_dir, algo, monkeypatch):
    seen = _spy_estimates(monkeypatch)
    check_forced_offload_equals_resident(model_dir, algo)
    if algo == "retroinfer":  # the comparison covered a contributing estimate
        assert any(bool(torch.isfinite(lse).any()) for lse in seen)


# ---- (d) stateless ----------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ALGOS)
def test_holds_no_tensors_across_calls_of_different_sizes(algo):
    a = get_algorithm_class(algo)(16, 3, 1, 1)
    assert tensors_of(a) == {}
    for hq, hkv, seed in ((4, 2, 0), (6, 3, 1)):
        k, v, table, num, last, q = _pool(hq, hkv, seed=seed)
        summ, _, _ = _indexed(a, k, v, table, num, last, 16)
        a.score(q, table, num, last, summ, k)
        sel = a.select(q, table, num, last, summ, k)
        a.estimate(q, sel, table, num, summ, 0.25)
        assert tensors_of(a) == {}


# ---- the fidelity harness (SmolLM2): the fast path's merge equals the engine's --------------
def test_smollm2_fidelity_harness_fast_path_and_batched_tail():
    """The harness's batched tail equals sequential engine decoding with the estimate merged,
    and its shared-text fast path (attend + lse) equals the engine kernels."""
    from sparseserve.bench.fidelity_metrics import compare_logits
    from sparseserve.bench.fidelity_tail import Setting, TailHarness
    from sparseserve.bench.texts import load_texts

    length, tail = 600, 64
    llm = LLM(max_num_seqs=32, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    h = TailHarness(llm.engine.runner, chunk_rows=32)
    text = load_texts(llm.get_tokenizer(), length, 1)[0]
    prep = h.prefill(text.token_ids, length - tail, algorithms=tuple(ALGOS))
    on, off = Setting("retroinfer", 128, 1, 1), Setting("retroinfer-noest", 128, 1, 1)
    seq = h.run_sequential(prep, on, steps=12)
    batched = h.run_tail(prep, on, fast=False).logits
    torch.testing.assert_close(batched[:12], seq, atol=2e-3, rtol=0)
    fast = h.run_tail(prep, on, fast=True).logits
    torch.testing.assert_close(fast, batched, atol=2e-3, rtol=0)
    assert compare_logits(batched, fast)["top1"] == 1.0
    without = h.run_tail(prep, off, fast=True).logits
    assert not torch.allclose(without, fast, atol=1e-3)  # the estimate did contribute
