"""The start-up warm-up (engine/warmup.py) runs the real step path, includes a hybrid step
(decode rows beside a prefill), and leaves no trace: no request, no page, no resident slot,
and the same greedy answers as an engine that never warmed up (all-resident and forced
offload). On the CPU it is explicit (LLMEngine warms up by itself on CUDA only)."""
import random

import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.engine.warmup import (WARMUP_PREFIX, continued_prompt_len, warm_up,
                                       warmup_prompt_lens)

PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K+V, 3 layers, page_size 16, head_dim 16, fp32 (llama-gqa)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
CONFIGS = {
    "dense": dict(page_size=16, max_num_seqs=4, max_model_len=256, device="cpu"),
    "offload": dict(page_size=16, max_num_seqs=4, max_model_len=256, device="cpu",
                    sparse_algorithm="arkvale", token_budget=64, sink_pages=1, local_pages=1,
                    kv_offload=True, kv_cache_memory_bytes=48 * PAGE_BYTES,
                    kv_offloading_size=200 * PAGE_BYTES / 2**30, max_num_batched_tokens=48),
}


def prompts():
    rng = random.Random(1)
    return [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]}
            for n in (1, 17, 54, 97)]


def warm_up_recording(eng, record) -> None:
    """warm_up(eng) with record(scheduler_output) called before each step executes."""
    execute = eng.executor.execute

    def recorded(out):
        record(out)
        return execute(out)

    eng.executor.execute = recorded
    try:
        assert warm_up(eng) > 0
    finally:
        eng.executor.execute = execute


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


def test_prompt_lens_cover_both_specialisations():
    lens = warmup_prompt_lens(32, 8192, 4)
    assert len(lens) == 2 and any(n % 16 for n in lens) and any(n % 16 == 0 for n in lens)
    assert all(n % 32 for n in lens if n % 16)  # the odd one also ends inside a page
    assert warmup_prompt_lens(16, 20, 4) == [15]  # clamped: prompt + decode fit max_model_len
    assert warmup_prompt_lens(16, 3, 4) == [1]


def test_continued_prompt_is_longer_than_a_chunk_within_its_caps():
    """Phase 2's prompt: whole pages past one chunk (its second chunk continues a prefix);
    two pages where max_model_len or a quarter of the cache does not allow that (no served
    prompt continues a prefix there either: layer-segmented prefill's budget is usually so)."""
    n = continued_prompt_len(32, 132096, 4, 2048, 163840)
    assert n == 2080 and n > 2048 and n % 32 == 0
    assert continued_prompt_len(16, 256, 4, 48, 12800) == 64  # 48 -> the next whole page past it
    assert continued_prompt_len(16, 256, 4, 2048, 12800) == 32  # past max_model_len
    assert continued_prompt_len(32, 32768, 4, 65536, 10**6) == 64  # segments of 65,536 tokens
    assert continued_prompt_len(16, 8192, 4, 2048, 1024) == 32  # past a quarter of the cache
    assert continued_prompt_len(16, 3, 4, 2048, 1024) == 1


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_warm_up_leaves_no_trace(model_dir, config):
    kw = CONFIGS[config]
    cold = LLM(model_dir, **kw)
    expected = cold.generate(prompts(), PARAMS, use_tqdm=False)
    llm = LLM(model_dir, **kw)
    eng = llm.engine
    free = eng.num_free_pages()
    chunks = []  # what each step scheduled: (decode rows, prefill chunks)
    warm_up_recording(eng, lambda out: chunks.append((sum(c.is_decode for c in out.chunks),
                                                      sum(not c.is_decode for c in out.chunks))))
    assert any(d and p for d, p in chunks), chunks  # a hybrid step ran
    # ... and one with two decode rows beside prefill work, and two prompts in one step
    # (Triton specialises integer arguments on == 1: one row does not compile two rows' kernels)
    assert any(d >= 2 and p >= 1 for d, p in chunks), chunks
    assert any(p >= 2 for d, p in chunks), chunks
    assert not eng.has_unfinished_requests()
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.num_free_pages() == free == eng.num_total_pages()
    eng.check_invariants()
    if config == "offload":
        stats = eng.get_stats()
        assert stats["device_kv_usage"] == 0  # every slot of the warm-up was released
    outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    for a, b in zip(outs, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in y:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5)
    with pytest.raises(RuntimeError, match="before the engine takes requests"):
        eng.add_request("busy", prompts()[1], PARAMS)
        warm_up(eng)
    eng.abort_request("busy")


def test_warm_up_with_two_rows_skips_the_third_phase(model_dir):
    """max_num_seqs = 2: no step can hold two decode rows beside a prefill; the warm-up runs its
    first two phases and still leaves nothing behind."""
    llm = LLM(model_dir, **{**CONFIGS["dense"], "max_num_seqs": 2})
    eng = llm.engine
    assert warm_up(eng) > 0
    assert not eng.has_unfinished_requests()
    assert eng.num_free_pages() == eng.num_total_pages()
    eng.check_invariants()


@pytest.mark.parametrize("inject", [8, 1000])
def test_layer_segmented_warm_up_runs_a_segment_from_layer_1(model_dir, inject):
    """Under layer-segmented prefill prompt A's first layer runs alone, then a segment from
    layer 1 (_first_layer_alone); with an injection budget below A (8 < 21 tokens: A chunked
    to it) too, where raising the budget to A for one step would leave A's segment larger than
    every later step's budget (never scheduled again). The scheduler's config is restored."""
    llm = LLM(model_dir, **{**CONFIGS["dense"], "max_inject_tokens": inject})
    eng = llm.engine
    cfg = eng.scheduler.cfg
    segments = []  # prompt A's prefill chunks: (first token, layer_start, layer_end)
    warm_up_recording(eng, lambda out: segments.extend(
        (c.start, c.layer_start, c.layer_end) for c in out.chunks
        if not c.is_decode and c.request_id == f"{WARMUP_PREFIX}0"))
    assert eng.scheduler.cfg is cfg is eng.config.scheduler
    assert segments[0] == (0, 0, 1) and segments[1][:2] == (0, 1), segments
    assert not eng.has_unfinished_requests()
    assert eng.num_free_pages() == eng.num_total_pages()
    eng.check_invariants()
