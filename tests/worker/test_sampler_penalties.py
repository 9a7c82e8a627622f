"""Penalties and logit_bias in the sampler against a direct torch reference of each formula
(vLLM semantics: repetition over prompt + output tokens, frequency / presence over output
tokens only, bias added first), over several decode steps with the state kept on the device."""
from collections import Counter

import pytest
import torch

from sparseserve.request import SamplingParams
from sparseserve.worker.sampler import Sampler, SamplingBatch

V = 40


def reference_logits(logits: torch.Tensor, prompt: list[int], outputs: list[int],
                     p: SamplingParams) -> torch.Tensor:
    x = logits.clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(outputs).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


PARAMS = [
    SamplingParams(temperature=0, repetition_penalty=1.7),
    SamplingParams(temperature=0, frequency_penalty=1.5),
    SamplingParams(temperature=0, presence_penalty=1.9),
    SamplingParams(temperature=0, presence_penalty=-0.7, frequency_penalty=0.4, repetition_penalty=0.8),
    SamplingParams(temperature=0, logit_bias={3: 4.0, 11: -2.5}, frequency_penalty=0.3),
    SamplingParams(temperature=0),  # no penalty: untouched, no state
]


def test_penalties_over_decode_steps_match_the_reference():
    torch.manual_seed(0)
    sampler = Sampler(torch.device("cpu"), 0)
    rows = [6, 1, 9, 3, 0, 4]  # runner rows, not batch order
    rids = [f"r{i}" for i in range(len(PARAMS))]
    prompts = [torch.randint(0, V, (int(torch.randint(3, 12, ())),)).tolist() for _ in PARAMS]
    outputs = [[] for _ in PARAMS]
    # prefill in two chunks (chunked prefill) for the first request, whole for the others
    fed = []
    for row, rid, prompt, p in zip(rows, rids, prompts, PARAMS):
        if p.has_penalties:
            fed += [(row, rid, prompt[:2]), (row, rid, prompt[2:])] if rid == "r0" else [(row, rid, prompt)]
    sampler.feed(fed, V)
    for step in range(12):
        # few distinct values so that repeats (and so penalties) matter
        logits = torch.randint(-4, 5, (len(PARAMS), V)).float() + torch.rand(len(PARAMS), V) * 0.1
        batch = SamplingBatch(list(PARAMS), [len(o) for o in outputs], rows=rows)
        got = sampler(logits, batch).token_ids.tolist()
        for i, p in enumerate(PARAMS):
            want = reference_logits(logits[i], prompts[i], outputs[i], p).argmax().item()
            assert got[i] == want, (step, i)
            outputs[i].append(got[i])
        sampler.feed([(r, rid, [o[-1]]) for r, rid, o, p in zip(rows, rids, outputs, PARAMS)
                      if p.has_penalties], V)  # the decode step feeds the sampled tokens
    assert any(len(set(o)) < len(o) for o in outputs[:4]), "no repeats: the test tested nothing"


def test_resumed_on_another_row_rebuilds_counts():
    """Preemption by recompute: the request comes back on a new row and re-feeds prompt +
    outputs; the frequency counts must cover exactly its outputs."""
    p = SamplingParams(temperature=0, frequency_penalty=2.0, repetition_penalty=1.3)
    prompt, outs = [1, 2, 3, 4], [5, 5, 6]
    s = Sampler(torch.device("cpu"), 0)
    s.feed([(2, "other", [7, 7, 7])], V)  # row 2 held another request before
    s.feed([(2, "req", prompt + outs[:1]), (2, "req", outs[1:])], V)
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6], logits[0, 8] = 4.5, 3.0, 1.0
    got = s(logits, SamplingBatch([p], [len(outs)], rows=[2])).token_ids.item()
    want = reference_logits(logits[0], prompt, outs, p).argmax().item()
    assert got == want == 8
    # the state of row 2 now holds "req" only: counts of 5 are 2, of 7 zero
    assert s.penalties.counts[2, 5] == 2 and s.penalties.counts[2, 7] == 0
    assert s.penalties.counts[2, 8] == 1  # the new sample is recorded


def test_logit_bias_shifts_the_sampling_distribution_and_logprobs_stay_raw():
    torch.manual_seed(1)
    logits = torch.randn(1, 8)
    p = SamplingParams(temperature=1.0, logit_bias={2: 3.0, 5: -100}, logprobs=2)
    n = 20000
    s = Sampler(torch.device("cpu"), 0)
    out = s(logits.expand(n, -1).contiguous(), SamplingBatch([p] * n, [0] * n))
    freq = torch.bincount(out.token_ids, minlength=8).float() / n
    ref = torch.softmax(reference_logits(logits[0], [], [], p), -1)
    assert freq[5] == 0
    assert torch.allclose(freq, ref, atol=0.015)
    raw = torch.log_softmax(logits[0], -1)
    assert torch.allclose(out.top_logprobs[0], raw.topk(2).values)  # vLLM: raw logprobs


def test_greedy_batch_with_bias_only_needs_no_state():
    s = Sampler(torch.device("cpu"), 0)
    logits = torch.zeros(2, V)
    out = s(logits, SamplingBatch([SamplingParams(temperature=0, logit_bias={17: 1.0}),
                                   SamplingParams(temperature=0, logit_bias={"9": 50})], [0, 0]))
    assert out.token_ids.tolist() == [17, 9]
    assert s.penalties.seen is None  # nothing allocated without penalties


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1.2), dict(frequency_penalty=0.5),
                                    dict(presence_penalty=0.5)])
def test_has_penalties(kwargs):
    assert SamplingParams(**kwargs).has_penalties
    assert not SamplingParams().has_penalties
