"""Every sparse algorithm (and dense) on the GPU: CUDA graphs == eager in the engine, forced
offload (a tiny HBM cache over pinned DRAM) == everything resident, every preset graphs ==
eager, and a captured select + attend replayed after host-side page-table updates == the same
calls made eagerly."""
import random

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.kernels import paged_decode_attention
from sparseserve.sparse import available_algorithms, get_algorithm_class

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ALGORITHMS = available_algorithms()  # dense, the sparse ones, oracle
# kv_offload refuses dense and oracle (they read every page every step): the rest offload
OFFLOADABLE = [a for a in ALGORITHMS if a not in ("dense", "oracle")]
LENGTHS = [1, 17, 54, 97, 130]
PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K+V, 3 layers, page_size 16, head_dim 16, fp32
SPARSE = dict(device="cuda", dtype="float32", page_size=16, token_budget=64, sink_pages=1,
              local_pages=1, max_num_seqs=4, max_model_len=256)
PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def prompts(seed=0):
    """One prompt of each length in LENGTHS (random token ids)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in LENGTHS]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_graphs_equal_eager(model_dir, algo):
    """Decode under CUDA graphs (page tables written into the graph's static buffers from the
    host every step) gives the tokens of eager decode; the budget (4 pages) is below most
    requests' pages, so selection really runs."""
    kw = dict(SPARSE, sparse_algorithm=algo, kv_cache_memory_bytes=16 << 20)
    graph = LLM(model_dir, **kw)
    assert graph.engine.runner.graphs is not None, graph.engine.runner.graph_error
    got = graph.generate(prompts(), PARAMS, use_tqdm=False)
    eager = LLM(model_dir, enforce_eager=True, **kw).generate(prompts(), PARAMS, use_tqdm=False)
    assert tokens(got) == tokens(eager)
    graph.engine.check_invariants()


@pytest.mark.parametrize("algo", OFFLOADABLE)
def test_forced_offload_equals_resident(model_dir, algo):
    """32 HBM slots per layer (the mandatory selection of 4 requests) over a pinned host tier,
    FlashH2D / FlashD2H, decode under CUDA graphs: token for token the resident output."""
    kw = dict(SPARSE, sparse_algorithm=algo)
    resident = LLM(model_dir, kv_cache_memory_bytes=16 << 20, **kw).generate(
        prompts(), PARAMS, use_tqdm=False)
    llm = LLM(model_dir, kv_offload=True, kv_cache_memory_bytes=32 * PAGE_BYTES,
              kv_offloading_size=200 * PAGE_BYTES / 2**30, h2d_method="flash",
              d2h_method="flash", max_num_batched_tokens=48, **kw)
    assert llm.engine.runner.graphs is not None, llm.engine.runner.graph_error
    start = llm.engine.get_stats()  # after the start-up warm-up (engine/warmup.py)
    outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert tokens(outs) == tokens(resident)
    stats = llm.engine.get_stats()
    if algo != "streaming":  # sink + recent pages: all stay resident after prefill
        assert stats["cache_misses_total"] > start["cache_misses_total"]
        assert stats["bytes_loaded_total"] > start["bytes_loaded_total"]
    llm.engine.check_invariants()


def _presets():
    try:
        from sparseserve.engine.presets import PRESETS
    except ImportError:
        return [pytest.param("none", marks=pytest.mark.skip(
            reason="sparseserve.engine.presets does not exist in this tree"))]
    return sorted(PRESETS)


@pytest.mark.parametrize("preset", _presets())
def test_presets_graphs_equal_eager(model_dir, preset):
    """Each preset (DESIGN.md §7) with CUDA graphs gives the tokens of its eager run; the
    offloading presets get a device cache of 32 slots per layer, so pages are evicted and
    reloaded while graphs replay."""
    from sparseserve.engine.presets import PRESETS

    kw = dict(SPARSE, preset=preset)
    offload = bool(PRESETS[preset].get("kv_offload"))
    if offload:
        kw.update(kv_cache_memory_bytes=32 * PAGE_BYTES,
                  kv_offloading_size=200 * PAGE_BYTES / 2**30, max_num_batched_tokens=48)
    else:
        kw.update(kv_cache_memory_bytes=16 << 20)
    graph = LLM(model_dir, **kw)
    misses = graph.engine.get_stats()["cache_misses_total"]  # after the start-up warm-up
    got = graph.generate(prompts(), PARAMS, use_tqdm=False)
    eager = LLM(model_dir, enforce_eager=True, **kw).generate(prompts(), PARAMS, use_tqdm=False)
    assert tokens(got) == tokens(eager)
    if PRESETS[preset].get("h2d_method") != "memcpy":  # per-page copies sync: no graphs
        assert graph.engine.runner.graphs is not None, graph.engine.runner.graph_error
    if offload:
        assert graph.engine.get_stats()["cache_misses_total"] > misses
    graph.engine.check_invariants()


def _pool(algo, B, Hq, Hkv, D, ps, W, gen, device="cuda"):
    """A K/V pool with every page indexed by the algorithm: (alg, k, v, summaries). Budget 6
    pages (dense: W + 1, every page)."""
    alg = get_algorithm_class(algo)(ps, W + 1 if algo == "dense" else 6, 1, 1)
    P = B * Hkv * W + 1
    k = torch.randn(P, ps, D, generator=gen).to(device)
    v = torch.randn(P, ps, D, generator=gen).to(device)
    rows = P + 1  # summaries have a scratch row
    summ = alg.make_summaries(rows, D, device=device)
    ids = torch.arange(P, dtype=torch.int32, device=device)
    full = torch.full((P,), ps, dtype=torch.int32, device=device)
    q_fill = torch.randn(P, Hq // Hkv, D, generator=gen).to(device) if alg.uses_queries else None
    alg.index(k, ids, full, summ, q_fill, **({"v_cache": v} if alg.uses_values else {}))
    return alg, k, v, summ


def _random_tables(B, Hkv, W, P, gen):
    """Host-side page tables: distinct random pages per (request, head), random lengths."""
    table = torch.randperm(P - 1, generator=gen)[:B * Hkv * W].view(B, Hkv, W).int()
    n = torch.randint(1, W + 1, (B,), generator=gen).int()
    num = n[:, None].expand(B, Hkv).contiguous()
    last = torch.randint(1, 17, (B,), generator=gen).int()
    return table, num, last


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_graph_replay_with_host_side_page_updates(algo):
    """select + paged decode attention captured once, then replayed after the host writes new
    page tables, lengths and queries into the static inputs: each replay equals the eager calls
    on the same inputs (same pages selected, same attention output)."""
    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, ps, W = 3, 8, 2, 64, 16, 20
    alg, k, v, summ = _pool(algo, B, Hq, Hkv, D, ps, W, gen)
    P = k.shape[0]
    table, num, last = (t.cuda() for t in _random_tables(B, Hkv, W, P, gen))
    q = torch.randn(B, Hq, D, generator=gen).cuda()

    def step():
        sel = alg.select(q, table, num, last, summ, k)
        out = paged_decode_attention(q, k, v, sel.page_table, sel.num_pages, sel.last_page_len,
                                     D ** -0.5)
        return sel, out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_sel, g_out = step()
    for _ in range(3):
        t, n, lst = _random_tables(B, Hkv, W, P, gen)
        table.copy_(t)
        num.copy_(n)
        last.copy_(lst)
        q.copy_(torch.randn(B, Hq, D, generator=gen))
        graph.replay()
        e_sel, e_out = step()
        torch.cuda.synchronize()
        assert torch.equal(g_sel.num_pages, e_sel.num_pages)
        m = e_sel.num_pages.long()
        want = n.long().clamp(max=alg.budget_pages)  # [B, Hkv]: budget 6 pages (dense: all)
        assert torch.equal(m.cpu(), want)
        for b in range(B):
            for h in range(Hkv):
                c = int(m[b, h])
                assert sorted(g_sel.blocks[b, h, :c].tolist()) == \
                    sorted(e_sel.blocks[b, h, :c].tolist()), (algo, b, h)
        torch.testing.assert_close(g_out, e_out, rtol=1e-5, atol=1e-5)
