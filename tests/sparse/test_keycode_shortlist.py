"""The key-code shortlist algorithms (``keycode2-sl``, ``keycode2-sl2``) in the CPU engine,
with a budget small enough that the shortlist is shorter than the page table (the two-stage
path, not keycode2's): forced offload (a tiny device pool) == everything resident, token for
token; a batch with chunked prefill == one request at a time; really sparse. (Every registered
algorithm also runs tests/sparse/test_sparse_engine.py's full-budget == dense and kept-page
checks and test_algorithm_state.py's no-state check.)"""
import random

import pytest

from sparseserve import LLM

from tests.kvcache.test_offload_engine import PARAMS, SPARSE, offload_llm
from tests.kvcache.test_offload_engine import model_dir  # noqa: F401

# 3 pages of 16 (sink, one scored page, the last page): S = 12 (sl) / 6 (sl2) pages of the
# table's 16; the longest prompt grows to 15 pages
SMALL = dict(SPARSE, token_budget=48)
LENGTHS = [1, 17, 54, 97, 200]


def prompts():
    rng = random.Random(1)
    return [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in LENGTHS]


def _spy(llm, seen):
    alg = llm.engine.runner.sparse.algorithm

    def on_select(layer, q, sel, c):
        seen.append((c.dec_page_table.shape[2], alg.shortlist_pages,
                     int(c.dec_num_pages.max()), int(sel.num_pages.max())))
    return on_select


@pytest.mark.parametrize("algo", ["keycode2-sl", "keycode2-sl2"])
def test_forced_offload_equals_resident_two_stage(model_dir, algo):  # noqa: F811
    resident = LLM(model_dir, **dict(SMALL, sparse_algorithm=algo)).generate(
        prompts(), PARAMS, use_tqdm=False)
    llm = offload_llm(model_dir, 32, sparse_algorithm=algo, token_budget=48,
                      max_num_batched_tokens=48)
    seen = []
    with llm.engine.runner.hooked(on_select=_spy(llm, seen)):
        outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    for a, b in zip(outs, resident):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in y:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)
    stats = llm.engine.get_stats()
    assert stats["cache_misses_total"] > 0 and stats["cache_hits_total"] > 0
    llm.engine.check_invariants()
    # the two-stage path ran: rows longer than the shortlist, the table wider than it
    assert any(w > s and n > s for w, s, n, _ in seen)
    assert max(m for *_, m in seen) <= 3


def test_batch_equals_apart_and_is_really_sparse(model_dir):  # noqa: F811
    kw = dict(SMALL, sparse_algorithm="keycode2-sl2", dense_layers=1)
    kw.pop("max_num_seqs")
    apart_llm = LLM(model_dir, max_num_seqs=1, **kw)
    apart = [apart_llm.generate(p, PARAMS, use_tqdm=False)[0] for p in prompts()]
    llm = LLM(model_dir, max_num_seqs=4, max_num_batched_tokens=20, **kw)
    batched = llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in apart]
    dense = LLM(model_dir, page_size=16, max_num_seqs=4, max_model_len=256,
                device="cpu").generate(prompts(), PARAMS, use_tqdm=False)
    assert any(a.outputs[0].logprobs != b.outputs[0].logprobs for a, b in zip(batched, dense))
