"""The sub-page-box and key-code algorithms under forced offload (a tiny device pool): the
device cache sees only pages, so the output equals everything resident, token for token."""
import pytest

from tests.kvcache.test_offload_engine import (PARAMS, SPARSE, model_dir, offload_llm,  # noqa: F401
                                               prompts)

from sparseserve import LLM


@pytest.mark.parametrize("algo", ["arkvale-b8", "quest-b16", "keycode1", "keycode2"])
def test_forced_offload_equals_resident_new_algorithms(model_dir, algo):  # noqa: F811
    resident = LLM(model_dir, **dict(SPARSE, sparse_algorithm=algo)).generate(
        prompts(), PARAMS, use_tqdm=False)
    llm = offload_llm(model_dir, 32, sparse_algorithm=algo, max_num_batched_tokens=48)
    outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    for a, b in zip(outs, resident):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in y:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)
    stats = llm.engine.get_stats()
    assert stats["cache_misses_total"] > 0 and stats["cache_hits_total"] > 0
    llm.engine.check_invariants()
