"""Whole-prompt causal attention padded to length buckets (worker/prefill_attention.py): the
buckets cover every length with bounded padding, the padded result equals unpadded SDPA, and the
engine with it (dense and the two-tier sparseserve path) generates the same tokens. On the GPU
the backend is cuDNN (tests/gpu/test_prefill_attention_gpu.py); here MATH, fp32."""
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from sparseserve import LLM, SamplingParams
from sparseserve.worker.prefill_attention import (PaddedCausalAttention, bucket_length,
                                                  bucket_lengths)


@pytest.mark.parametrize("n", [1, 17, 54, 97, 511, 512, 513, 4096, 4097, 9970, 23433, 131071])
def test_bucket_bounds(n):
    b = bucket_length(n)
    assert b >= n and b % 512 == 0
    assert b - n < max(512, 0.125 * n)  # under one step of padding: 12.5% above 4k
    assert bucket_length(b) == b  # a bucket is its own bucket


def test_bucket_lengths_cover_every_length():
    buckets = bucket_lengths(24576)
    assert buckets == sorted(set(buckets)) and buckets[-1] == 24576
    assert len(buckets) == 28  # 8 per octave above 4k: ~2 s of cuDNN plans at start-up
    assert all(bucket_length(n) in buckets for n in range(1, 24577, 7))
    assert len(bucket_lengths(131072)) == 48


@pytest.mark.parametrize("n", [1, 17, 97, 600])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_padded_equals_unpadded(n, heads):
    hq, hkv = heads
    torch.manual_seed(n)
    q, k, v = (torch.randn(n, h, 16) for h in (hq, hkv, hkv))
    attn = PaddedCausalAttention(hq, hkv, 16, 0.3, torch.float32, torch.device("cpu"),
                                 backend=SDPBackend.MATH)
    assert attn(q, k, v) is None  # nothing warmed: declined, never builds a plan in serving
    assert attn.warm_up(1024) == [512, 1024]
    out = attn(q, k, v)
    kr, vr = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kr.transpose(0, 1),
                                         vr.transpose(0, 1), is_causal=True, scale=0.3)
    assert out.shape == (n, hq, 16)
    torch.testing.assert_close(out, ref.transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert attn(torch.randn(1025, hq, 16), torch.randn(1025, hkv, 16),
                torch.randn(1025, hkv, 16)) is None  # beyond the warmed buckets


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K+V, 3 layers, page_size 16, head_dim 16, fp32


@pytest.mark.parametrize("preset", ["dense", "sparseserve"])
def test_engine_tokens_unchanged(model_dir, preset):
    kw = dict(page_size=16, max_num_seqs=4, max_model_len=256, device="cpu", preset=preset,
              max_num_batched_tokens=256)
    if preset == "sparseserve":
        kw.update(token_budget=64, kv_cache_memory_bytes=64 * PAGE_BYTES,
                  kv_offloading_size=200 * PAGE_BYTES / 2**30)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]}
               for n in (1, 17, 54, 97)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    llm = LLM(model_dir, **kw)
    runner = llm.engine.runner
    assert runner.prefill_attn is None  # CPU: not built
    base = llm.generate(prompts, params, use_tqdm=False)
    calls = []
    attn = PaddedCausalAttention(4, 2, 16, runner.scale, torch.float32, torch.device("cpu"),
                                 backend=SDPBackend.MATH)
    attn.warm_up(256)

    def counted(q, k, v):
        calls.append(q.shape[0])
        return attn(q, k, v)
    runner.prefill_attn = counted
    padded = llm.generate(prompts, params, use_tqdm=False)
    assert sorted(set(calls)) == [1, 17, 54, 97]  # every whole prompt went through it
    for a, b in zip(base, padded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            t = next(iter(la))
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4
