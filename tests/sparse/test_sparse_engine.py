"""Sparse decode in the engine: equal to dense when the budget covers everything, batch
invariant when it does not, and selection invariants (kept pages, exact budget)."""
import random

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.sparse import available_algorithms, get_algorithm_class
from sparseserve.sparse.base import LayerSummaries

LENGTHS = [1, 17, 54, 97]


def prompts():
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in LENGTHS]


PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


@pytest.fixture(scope="module")
def dense_out(model_dir):
    return LLM(model_dir, page_size=16, max_num_seqs=4).generate(prompts(), PARAMS,
                                                                 use_tqdm=False)


@pytest.mark.parametrize("algo", [a for a in available_algorithms() if a != "dense"])
def test_full_budget_equals_dense(model_dir, dense_out, algo):
    llm = LLM(model_dir, page_size=16, max_num_seqs=4, sparse_algorithm=algo,
              token_budget=512, sink_pages=1, local_pages=1)
    outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    for got, ref in zip(outs, dense_out):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs):
            for t in b:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    llm.engine.check_invariants()


@pytest.mark.parametrize("algo", ["quest", "arkvale", "infllm"])
def test_sparse_batch_equals_apart_and_is_really_sparse(model_dir, algo):
    kw = dict(page_size=16, sparse_algorithm=algo, token_budget=64, sink_pages=1,
              local_pages=1, dense_layers=1)
    apart_llm = LLM(model_dir, max_num_seqs=1, **kw)
    apart = [apart_llm.generate(p, PARAMS, use_tqdm=False)[0] for p in prompts()]
    # chunked prefill makes steps that mix sparse decode tokens with prefill chunks
    llm = LLM(model_dir, max_num_seqs=4, max_num_batched_tokens=20, **kw)
    seen = []

    def spy(layer, q, sel, c):
        seen.append((c.num_decode, len(c.prefills), sel.num_pages.max().item(),
                     c.dec_num_pages.max().item()))

    runner = llm.engine.runner
    mixed, sentinel = runner.mixed, object()  # whole-step graphs (a GPU's): off while hooked
    runner.mixed = sentinel
    with runner.hooked(on_select=spy):
        assert runner.mixed is None
        batched = llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert runner.mixed is sentinel  # restored on exit
    runner.mixed = mixed
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in apart]
    assert any(nd and npre for nd, npre, _, _ in seen), "no step mixed decode and prefill"
    assert max(s for _, _, s, _ in seen) <= 4  # 64-token budget = 4 pages
    assert max(t for _, _, _, t in seen) > 4  # requests longer than the budget existed
    dense = LLM(model_dir, page_size=16, max_num_seqs=4).generate(prompts(), PARAMS,
                                                                  use_tqdm=False)
    assert any(a.outputs[0].logprobs != b.outputs[0].logprobs for a, b in zip(batched, dense))


@pytest.mark.parametrize("algo", [a for a in available_algorithms() if a != "dense"])
def test_select_keeps_sink_local_last_and_respects_budget(algo):
    torch.manual_seed(0)
    B, hkv, G, D, ps, W = 3, 2, 2, 16, 16, 40
    sink, local, budget = 2, 3, 8
    algo_obj = get_algorithm_class(algo)(ps, budget, sink, local)
    P = B * W * hkv + 1
    k_cache = torch.randn(P, ps, D)
    summaries = algo_obj.make_summaries(P, D)
    page_table = torch.randperm(P - 1)[:B * hkv * W].view(B, hkv, W).int()
    n_pages = torch.tensor([1, 7, 37], dtype=torch.int32)[:, None].expand(B, hkv).contiguous()
    last_len = torch.tensor([5, 16, 9], dtype=torch.int32)
    full = torch.full((B * hkv * W,), ps, dtype=torch.int32)
    queries = torch.randn(B * hkv * W, G, D)
    algo_obj.index(k_cache, page_table.reshape(-1), full, summaries, queries)
    q = torch.randn(B, hkv * G, D)
    sel = algo_obj.select(q, page_table, n_pages, last_len, summaries, k_cache)
    for b in range(B):
        n = n_pages[b, 0].item()
        for h in range(hkv):
            m = sel.num_pages[b, h].item()
            blocks = sel.blocks[b, h, :m].tolist()
            assert len(set(blocks)) == m, "a page selected twice"
            assert blocks[-1] == n - 1, "partial last page not last"
            kept = set(range(min(sink, n))) | set(range(max(0, n - local), n))
            assert kept <= set(blocks)
            assert m == min(n, budget)
            if algo == "streaming":
                assert set(blocks) == set(range(min(sink, n))) | set(range(max(0, n - budget + sink), n))
            assert sel.page_table[b, h, :m].tolist() == page_table[b, h, blocks].tolist()
