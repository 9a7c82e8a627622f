"""Forced offload on the embedded SmolLM2 (real weights from the GGUF): a device cache a few
pages per request wide gives token-for-token the greedy output of the all-resident sparse
engine, for concurrent requests of different lengths; nothing leaks."""
import random

from sparseserve import LLM, SamplingParams

SPARSE = dict(page_size=16, sparse_algorithm="arkvale", token_budget=64, sink_pages=1,
              local_pages=1, max_num_seqs=3, max_model_len=256, max_num_batched_tokens=96,
              device="cpu")


def test_smollm2_forced_offload_equals_resident():
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]}
               for n in (97, 17, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    resident = LLM(**SPARSE).generate(prompts, params, use_tqdm=False)
    # SmolLM2: 30 layers, 3 KV heads, head_dim 64, fp32 on CPU
    page_bytes = 2 * 30 * 16 * 64 * 4
    # the smallest cache allowed: one max_model_len prompt (16 pages x 3 KV heads) in slots
    # while it is prefilled; the three requests together need more
    slots = 256 // 16 * 3
    llm = LLM(**SPARSE, kv_offload=True, kv_cache_memory_bytes=slots * page_bytes,
              kv_offloading_size=400 * page_bytes / 2**30)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs, resident):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    stats = llm.engine.get_stats()
    assert stats["cache_misses_total"] > 0 and stats["bytes_saved_total"] > 0
    llm.engine.check_invariants()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
