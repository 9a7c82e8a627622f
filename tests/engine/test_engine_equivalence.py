"""Engine equivalences on a tiny random model: batching, chunking, layer segments,
preemption and seeds must not change what is generated."""
import pytest

from sparseserve import LLM, SamplingParams

LENGTHS = [1, 17, 54, 97]


def prompts(n_each=1):
    import random
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]}
            for n in LENGTHS for _ in range(n_each)]


def greedy(max_tokens=24):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(path, **kw):
    kw.setdefault("page_size", 16)
    kw.setdefault("device", "cpu")  # CPU-sized caches and fp32; tests/gpu covers the GPU
    return LLM(path, **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = make_llm(model_dir, max_num_seqs=1)
    return [tokens(llm.generate(p, greedy(), use_tqdm=False))[0] for p in prompts()]


def test_batched_equals_one_at_a_time(model_dir, reference):
    llm = make_llm(model_dir, max_num_seqs=8)
    assert tokens(llm.generate(prompts(), greedy(), use_tqdm=False)) == reference
    llm.engine.check_invariants()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


def test_chunked_prefill_equals_unchunked(model_dir, reference):
    llm = make_llm(model_dir, max_num_seqs=8, max_num_batched_tokens=13)
    assert tokens(llm.generate(prompts(), greedy(), use_tqdm=False)) == reference


# 3 layers; 40 token-layers per step: the 97- and 54-token prompts are chunked to 40 and run
# one layer per step, 17 runs 2 layers per step, 1 all three; 300: no chunking, 1-3 layers
@pytest.mark.parametrize("inject", [40, 300])
def test_layer_segmented_prefill_equals_plain(model_dir, reference, inject):
    llm = make_llm(model_dir, max_num_seqs=8, max_inject_tokens=inject,
                   max_num_batched_tokens=40)
    outs = llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=24,
                                                  ignore_eos=True, logprobs=3), use_tqdm=False)
    assert tokens(outs) == reference
    llm.engine.check_invariants()


def test_layer_segmented_logits_equal_plain(model_dir):
    """The first token's log-probabilities (the logits) agree, not only the argmax."""
    p = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    plain = make_llm(model_dir).generate(prompts()[3], p, use_tqdm=False)[0]
    seg = make_llm(model_dir, max_inject_tokens=97).generate(prompts()[3], p,
                                                              use_tqdm=False)[0]
    a, b = plain.outputs[0].logprobs[0], seg.outputs[0].logprobs[0]
    assert a.keys() == b.keys()
    for t in a:
        assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_preempted_and_recomputed_equals_uninterrupted(model_dir, reference):
    # 3 layers x 2 KV heads x 16 tokens x 16 dims x 2 (K,V) x 4 bytes = 12 KiB per page;
    # 28 pages = 14 token blocks: the prompts fit, but not all four requests finishing together
    page_bytes = 3 * 2 * 16 * 16 * 4
    llm = make_llm(model_dir, max_num_seqs=8, kv_cache_memory_bytes=28 * page_bytes,
                   max_model_len=160)
    outs = llm.generate(prompts(), greedy(), use_tqdm=False)
    assert tokens(outs) == reference
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.engine.check_invariants()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


def test_seeded_sampling_is_reproducible(model_dir):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20,
                       ignore_eos=True)
    llm = make_llm(model_dir, max_num_seqs=8)
    alone = tokens(llm.generate(prompts()[2], p, use_tqdm=False))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3
    batch = llm.generate(prompts()[:3] + [prompts()[2]], others + [p], use_tqdm=False)
    assert tokens(batch)[3] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=20,
                                ignore_eos=True)
    assert tokens(llm.generate(prompts()[2], other_seed, use_tqdm=False))[0] != alone


def test_no_page_leaks_after_many_requests(model_dir):
    import random
    rng = random.Random(1)
    llm = make_llm(model_dir, max_num_seqs=6, max_num_batched_tokens=64,
                   kv_cache_memory_bytes=60 * 3 * 2 * 16 * 16 * 4, max_model_len=200)
    for _ in range(3):
        ps = [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(rng.randrange(1, 90))]}
              for _ in range(20)]
        params = [SamplingParams(temperature=rng.choice([0.0, 0.8]),
                                 max_tokens=rng.randrange(1, 30)) for _ in ps]
        outs = llm.generate(ps, params, use_tqdm=False)
        assert all(o.finished for o in outs)
        llm.engine.check_invariants()
        assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
