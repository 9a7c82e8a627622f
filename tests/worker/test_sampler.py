"""Sampler filters against a direct computation of the filtered distribution."""
import pytest
import torch

from sparseserve.request import SamplingParams
from sparseserve.worker.sampler import Sampler, SamplingBatch


def reference_probs(logits, p: SamplingParams):
    x = logits / p.temperature
    probs = torch.softmax(x, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, idx in enumerate(order.tolist()):
        if p.top_k > 0 and rank >= p.top_k:
            break
        keep[idx] = True
        mass += probs[idx].item()
        if mass >= p.top_p:
            break
    filt = torch.where(keep, probs, torch.zeros_like(probs))
    filt = filt / filt.sum()
    if p.min_p > 0:
        filt = torch.where(filt >= p.min_p * filt.max(), filt, torch.zeros_like(filt))
        filt = filt / filt.sum()
    return filt


@pytest.mark.parametrize("p", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.8, min_p=0.2),
])
def test_sampling_matches_filtered_distribution(p):
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    n = 20000
    sampler = Sampler(torch.device("cpu"), seed=0)
    rows = logits.expand(n, -1).contiguous()
    batch = SamplingBatch(params=[p] * n, num_output_tokens=[0] * n)
    toks = sampler(rows, batch).token_ids
    freq = torch.bincount(toks, minlength=12).float() / n
    ref = reference_probs(logits[0], p)
    assert torch.all(freq[ref == 0] == 0), "sampled a filtered-out token"
    assert torch.allclose(freq, ref, atol=0.015)


def test_greedy_rows_and_logprobs_in_mixed_batch():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0, logprobs=4), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0)]
    out = Sampler(torch.device("cpu"), 0)(logits, SamplingBatch(params, [0, 0, 0]))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.top_logprobs[0], ref[0].topk(4).values)
    assert out.sampled_rank[0] == 1


def test_seeded_rows_do_not_depend_on_batch():
    logits = torch.randn(4, 100)
    p = SamplingParams(temperature=1.0, seed=7)
    s = Sampler(torch.device("cpu"), 0)
    a = s(logits[2:3], SamplingBatch([p], [5])).token_ids
    others = [SamplingParams(temperature=1.0)] * 3
    b = s(logits, SamplingBatch(others[:2] + [p] + others[2:], [0, 0, 5, 0])).token_ids
    assert a.item() == b[2].item()


def test_parameter_tensors_are_built_once_per_batch_composition():
    """A steady batch reuses its parameter tensors (sampling_tensors.py); a row crossing
    min_tokens or a new params object rebuilds them; tokens equal a rebuild every step."""
    from sparseserve.worker.sampling_tensors import SamplingTensorCache
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=0.0, repetition_penalty=1.2, logit_bias={3: 2.0}),
              SamplingParams(temperature=1.0, min_p=0.1, top_k=9, presence_penalty=0.5)]
    cached, fresh = Sampler(torch.device("cpu"), 0), Sampler(torch.device("cpu"), 0)
    for s in (cached, fresh):
        s.feed([(1, "b", [3, 4]), (2, "c", [5])], 50)
    torch.manual_seed(0)
    for step in range(6):
        logits = torch.randn(3, 50)
        if step == 4:
            params = params[:2] + [SamplingParams(temperature=0.5)]
        stop = [(), (), (7,)] if step < 2 else None
        fresh.tensors = SamplingTensorCache()
        a = cached(logits, SamplingBatch(params, [step] * 3, stop_ids=stop))
        b = fresh(logits, SamplingBatch(params, [step] * 3, stop_ids=stop))
        assert torch.equal(a.token_ids, b.token_ids)
    assert cached.tensors.builds == 3  # steps 0, 2 (min_tokens reached), 4 (new params)
