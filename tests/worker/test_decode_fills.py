"""Decode steps skip indexing filled pages when the host knows no token completes one
(model_runner.decode_fills -> OffloadForwardContext.decode_fills; the CUDA graphs capture both
variants). Checked against the same engine that indexes (masked) on every step: the same
tokens, logprobs and summary rows, through several page boundaries at odd prompt lengths."""
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.engine.sched_output import ScheduledChunk
from sparseserve.worker import model_runner
from sparseserve.worker.model_runner import decode_fills

PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K+V, 3 layers, page_size 16, head_dim 16, fp32


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


def chunk(start: int) -> ScheduledChunk:
    return ScheduledChunk(request_id="r", row=0, token_ids=[1], start=start, layer_start=0,
                          layer_end=3, sample=True, num_output_tokens=1)


@pytest.mark.parametrize("starts,expected", [
    ([0], False), ([15], True), ([16], False), ([14, 17, 53], False), ([14, 31, 53], True),
    ([], False), ([4096], False), ([4095], True)])
def test_decode_fills_is_true_exactly_when_a_token_completes_its_page(starts, expected):
    assert decode_fills([chunk(s) for s in starts], 16) is expected


def run(model_dir, monkeypatch, always_index: bool):
    if always_index:
        monkeypatch.setattr(model_runner, "decode_fills", lambda chunks, page_size: True)
    llm = LLM(model_dir, preset="sparseserve", device="cpu", page_size=16, token_budget=64,
              sink_pages=1, local_pages=1, max_num_seqs=4, max_model_len=256,
              kv_cache_memory_bytes=40 * PAGE_BYTES, kv_offloading_size=800 * PAGE_BYTES / 2**30)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True, logprobs=1)
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate((17, 54, 97)):  # pages fill at different steps per row
        ids = torch.randint(3, 200, (n,), generator=g).tolist()
        eng.add_request(str(i), {"prompt_token_ids": ids}, params)
    outs, summaries = {}, None
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
        if steps == 60:  # mid-decode, every request still holds its pages
            summaries = [{k: t.clone() for k, t in s.tensors.items()}
                         for s in eng.runner.sparse.summaries]
    eng.shutdown()
    monkeypatch.undo()
    return outs, summaries


def test_skipping_the_index_on_steps_without_fills_changes_nothing(model_dir, monkeypatch):
    got, got_sum = run(model_dir, monkeypatch, always_index=False)
    ref, ref_sum = run(model_dir, monkeypatch, always_index=True)
    assert sorted(got) == sorted(ref) == ["0", "1", "2"]
    for rid in ref:
        a, b = got[rid].outputs[0], ref[rid].outputs[0]
        assert a.token_ids == b.token_ids and len(a.token_ids) == 70
        assert [next(iter(d.values())).logprob for d in a.logprobs] == \
            [next(iter(d.values())).logprob for d in b.logprobs]
    assert got_sum is not None and len(got_sum) == len(ref_sum) == 3
    for layer_got, layer_ref in zip(got_sum, ref_sum):
        for name in layer_ref:
            assert torch.equal(layer_got[name], layer_ref[name]), name
