"""Tensor parallelism end to end on the CPU (gloo): an LLM with tensor_parallel_size=2 (tiny
GQA and MHA models) or 3 (SmolLM2, 3 KV heads) gives the greedy tokens of the TP=1 engine
(itself tested against transformers) and its logprobs within fp32 tolerance, for dense and
sparse decode and forced offload, with concurrent requests of odd lengths; a dead or hung
rank makes the engine raise, not hang."""
import os
import random
import signal
import time

import pytest

from sparseserve import LLM, SamplingParams

LENGTHS = [1, 17, 54, 97]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
BASE = dict(page_size=16, device="cpu", max_num_seqs=4, max_model_len=256,
            kv_cache_memory_bytes=4 << 20)
ARKVALE = dict(sparse_algorithm="arkvale", token_budget=64, sink_pages=1, local_pages=1)
PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K+V, 3 layers, page_size 16, head_dim 16, fp32


def prompts(seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in LENGTHS]


def assert_same(outs, ref, tol=1e-4):
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in y:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=tol)


@pytest.fixture
def engines():
    """Engines of one test, shut down (their rank processes stopped) at its end."""
    made = []

    def make(path, **kw):
        llm = LLM(path, **dict(BASE, **kw))
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha"])
@pytest.mark.parametrize("algo", ["dense", "arkvale"])
def test_tp2_equals_tp1(tiny_model_dirs, engines, kind, algo):
    path = tiny_model_dirs[kind][0]
    kw = ARKVALE if algo == "arkvale" else {}
    ref = engines(path, **kw).generate(prompts(), PARAMS, use_tqdm=False)
    llm = engines(path, tensor_parallel_size=2, **kw)
    assert llm.engine.runner is None  # the model lives in the ranks
    outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert_same(outs, ref)
    # a second batch reuses the freed rows and pages of the first
    assert_same(llm.generate(prompts(1), PARAMS, use_tqdm=False), ref_second(path, kw, engines))
    llm.engine.check_invariants()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
    ex = llm.engine.executor
    assert ex.graph_info() == {"batch_sizes": None, "error": None}  # rank 0's; eager on CPU
    with pytest.raises(RuntimeError, match="the harness needs the in-process model runner.*"
                                           "tensor_parallel_size=1"):
        ex.local_runner("the harness")
    per_step = ex.bytes_sent_total / ex.num_sent
    print(f"\n{kind} {algo}: SchedulerOutput broadcast {per_step:.0f} B/step, "
          f"{ex.send_s_total / ex.num_sent * 1e6:.0f} us/step over {ex.num_sent} steps")
    assert per_step < 16 << 10


def ref_second(path, kw, engines):
    """TP=1 output of the second batch (its own engine: the same row / page history)."""
    ref = engines(path, **kw)
    ref.generate(prompts(), PARAMS, use_tqdm=False)
    return ref.generate(prompts(1), PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def kv3_model(tmp_path_factory):
    """A tiny Llama with 3 KV heads (6 query heads, head_dim 16, hidden 96, MLP 192): TP=3
    splits everything three ways, the vocabulary of 320 with padding on the last rank."""
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=96, intermediate_size=192,
                                   num_hidden_layers=3, num_attention_heads=6,
                                   num_key_value_heads=3, head_dim=16,
                                   max_position_embeddings=1024, rope_theta=10000.0,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)  # attention far from uniform: tokens differ
    path = str(tmp_path_factory.mktemp("kv3"))
    model.save_pretrained(path, max_shard_size="100KB")
    return path


def test_tp3_sparse_equals_tp1(kv3_model, engines):
    """One KV head per rank, ArkVale decode with a 4-page budget over prompts of up to 7
    pages (selection is active), four concurrent requests."""
    ref = engines(kv3_model, **ARKVALE).generate(prompts(), PARAMS, use_tqdm=False)
    llm = engines(kv3_model, tensor_parallel_size=3, **ARKVALE)
    assert_same(llm.generate(prompts(), PARAMS, use_tqdm=False), ref)
    llm.engine.check_invariants()


def test_tp3_forced_offload_equals_tp1_resident(kv3_model, engines):
    """Each of 3 ranks: 16 device slots and a host tier for its one KV head, the batch
    reaching ~29 pages per head: pages are evicted and loaded back."""
    batch = prompts() + [{"prompt_token_ids": list(range(3, 133))}]  # 130 tokens
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)
    ref = engines(kv3_model, **ARKVALE).generate(batch, params, use_tqdm=False)
    llm = engines(kv3_model, tensor_parallel_size=3, kv_offload=True,
                  kv_cache_memory_bytes=16 * PAGE_BYTES,
                  kv_offloading_size=3 * 96 * PAGE_BYTES / 2**30, max_num_batched_tokens=48,
                  **ARKVALE)
    assert_same(llm.generate(batch, params, use_tqdm=False), ref)
    stats = llm.engine.get_stats()
    assert stats["cache_misses_total"] > 0 and stats["bytes_saved_total"] > 0
    assert llm.engine.executor.offload_stats()["total_slots"] == 3 * 3 * 16
    llm.engine.check_invariants()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


@pytest.mark.parametrize("kind,heads", [("llama-gqa", 1), ("llama-mha", 2)])
def test_tp2_forced_offload_equals_tp1_resident(tiny_model_dirs, engines, kind, heads):
    """Each rank's device cache and host tier hold its KV heads (`heads` of them): 16 slots
    per head and rank, fewer than the ~29 pages per head the batch reaches, so pages are
    evicted and loaded back; kv_offloading_size is the total (each rank gets half)."""
    path = tiny_model_dirs[kind][0]
    batch = prompts() + [{"prompt_token_ids": list(range(3, 133))}]  # 130 tokens
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)
    ref = engines(path, **ARKVALE).generate(batch, params, use_tqdm=False)
    llm = engines(path, tensor_parallel_size=2, kv_offload=True,
                  kv_cache_memory_bytes=16 * heads * PAGE_BYTES,
                  kv_offloading_size=2 * 100 * heads * PAGE_BYTES / 2**30,
                  max_num_batched_tokens=48, **ARKVALE)
    cache = llm.engine.config.cache
    assert cache.num_pages == 16 * heads and cache.num_host_pages == 96 * heads  # per rank
    assert_same(llm.generate(batch, params, use_tqdm=False), ref)
    stats = llm.engine.get_stats()
    print(f"\nTP=2 forced offload ({kind}):", stats)
    assert stats["cache_misses_total"] > 0 and stats["bytes_saved_total"] > 0
    # summed over the ranks: ranks x layers x slots per rank
    assert llm.engine.executor.offload_stats()["total_slots"] == 2 * 3 * 16 * heads
    llm.engine.check_invariants()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


def test_kv_heads_not_divisible_says_what_to_do(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide.*"
                                         r"num_key_value_heads = 2.*among \[1, 2\]"):
        LLM(tiny_model_dirs["llama-gqa"][0], tensor_parallel_size=3, **BASE)


def test_dead_rank_raises_within_timeout(tiny_model_dirs, engines):
    llm = engines(tiny_model_dirs["llama-gqa"][0], tensor_parallel_size=2)
    eng = llm.engine
    for i, p in enumerate(prompts()):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=50,
                                                  ignore_eos=True))
    for _ in range(3):
        eng.step()
    os.kill(eng.executor.pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 .*died|rank 0 failed"):
        while eng.has_unfinished_requests():
            eng.step()
    assert time.monotonic() - t0 < 30
    with pytest.raises(RuntimeError):
        eng.check_health()  # what the server's /health turns into 503
    assert not any(p.is_alive() for p in eng.executor.procs)  # every rank stopped


def test_hung_rank_raises_after_the_timeout(tiny_model_dirs):
    """A rank that stops answering (SIGSTOP: alive, but silent) makes the step raise once
    the executor's timeout (SPARSESERVE_TP_TIMEOUT_S; 3 s here) has passed, and every rank
    is stopped."""
    llm = LLM(tiny_model_dirs["llama-gqa"][0], tensor_parallel_size=2, **BASE)
    eng = llm.engine
    ex = eng.executor
    try:
        eng.add_request("0", prompts()[2], SamplingParams(temperature=0.0, max_tokens=50,
                                                          ignore_eos=True))
        eng.step()
        ex.timeout_s = 3.0
        os.kill(ex.pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"did not answer 'execute' within 3 s.*hangs"):
            while eng.has_unfinished_requests():
                eng.step()
        assert time.monotonic() - t0 < 3.0 + 10
        assert not any(p.is_alive() for p in ex.procs)
        with pytest.raises(RuntimeError, match="hangs"):
            eng.check_health()
    finally:
        for p in ex.procs:
            if p.is_alive():
                p.kill()
        eng.shutdown()


def test_tp3_smollm2_equals_tp1(smollm2_llm, engines):
    """SmolLM2-135M (GGUF, 9 query / 3 KV heads): one KV head per rank, three concurrent
    requests. A few tokens only: three CPU ranks of a real model are slow."""
    batch = [{"prompt_token_ids": p["prompt_token_ids"][:n]}
             for p, n in zip(prompts(), [1, 17, 54])]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1)
    ref = smollm2_llm.generate(batch, params, use_tqdm=False)
    llm = engines(None, tensor_parallel_size=3, max_model_len=64,
                  kv_cache_memory_bytes=8 << 20)
    assert_same(llm.generate(batch, params, use_tqdm=False), ref, tol=1e-3)

