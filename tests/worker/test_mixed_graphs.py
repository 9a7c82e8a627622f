"""Whole-step graphs for mixed steps (worker/mixed_graphs.py, cudagraph_mode FULL): through the
engine, steps with prefill chunks (odd prompt lengths, chunks continuing prefixes, not
page-aligned) beside decode rows give the tokens and logprobs of the op-by-op path; steps that
cannot run whole (prompt logprobs) fall back; the metadata sizing holds for the worst case. On
CPU tensors the forward runs uncaptured (Triton's interpreter for the kernels); on a GPU it is
captured at start-up by the engine itself."""
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.kernels.paged_prefill import plan_blocks
from sparseserve.worker.mixed_graphs import MixedStepGraphs
from sparseserve.worker.piecewise_graphs import token_buckets

from tests.conftest import DEVICE

LENS = (1, 17, 54, 97, 33, 5)
BUDGET = 40  # tokens per step: chunks continue prefixes, off page boundaries (page 16)


def _prompts():
    return [{"prompt_token_ids": [3 + (j * (i + 7)) % 300 for j in range(n)]}
            for i, n in enumerate(LENS)]


def _generate(path, mixed, params, **kw):
    llm = LLM(path, device=DEVICE.type, dtype="float32", page_size=16, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=BUDGET, kv_cache_memory_bytes=1 << 24,
              **kw)
    runner = llm.engine.runner
    runner.model.fused_ops = True  # the path the graphs run (compiled on a GPU)
    calls = []
    if mixed:
        if runner.mixed is None:  # CPU: built here, run uncaptured
            runner.mixed = MixedStepGraphs(runner, token_buckets(BUDGET), 4, capture=False)
            runner.mixed.capture()
        run = runner.mixed.run
        runner.mixed.run = lambda chunks, *a: calls.append(
            (len(chunks), sum(c.is_decode for c in chunks))) or run(chunks, *a)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    llm.engine.check_invariants()
    return outs, calls


def _same(got, want, tol=1e-4):
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) < tol


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha"])
def test_engine_tokens_equal_eager(tiny_model_dirs, kind):
    path, _ = tiny_model_dirs[kind]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    kw = {"cudagraph_mode": "FULL"} if DEVICE.type == "cuda" else {}
    want, _ = _generate(path, False, params)
    got, calls = _generate(path, True, params, **kw)
    _same(got, want, 1e-4 if DEVICE.type == "cpu" else 2e-3)
    assert calls, "no step with prefill work ran whole"
    assert any(0 < nd < n for n, nd in calls), "no hybrid step (decode rows beside a chunk)"


def test_prompt_logprobs_fall_back(tiny_model_dirs):
    """A request asking for prompt logprobs needs every row's hidden state: its steps run op
    by op, with the same prompt logprobs as without the graphs."""
    path, _ = tiny_model_dirs["llama-gqa"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    want, _ = _generate(path, False, params)
    got, calls = _generate(path, True, params)
    assert not calls
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [None if d is None else sorted(d) for d in g.prompt_logprobs] == \
            [None if d is None else sorted(d) for d in w.prompt_logprobs]


def test_grid_covers_the_worst_split():
    """grid(b) programs cover every way b tokens can fall into max_seqs chunks."""
    class Stub:
        pass

    g = Stub()
    g.block_m, g.max_seqs = 32, 4
    grid = MixedStepGraphs.grid.__get__(g)
    for b in (16, 40, 97, 2048):
        worst = max(len(plan_blocks(lens, 32)[0]) for lens in
                    ([b], [1] * 3 + [b - 3], [33] * 3 + [b - 99] if b > 99 else [b],
                     [b // 4 + 1] * 3 + [b - 3 * (b // 4 + 1)] if b > 8 else [b])
                    if all(x >= 1 for x in lens))
        assert worst <= grid(b)


def test_too_many_chunks_is_an_error(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = LLM(path, device="cpu", dtype="float32", page_size=16, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=BUDGET, kv_cache_memory_bytes=1 << 24)
    mixed = MixedStepGraphs(llm.engine.runner, token_buckets(BUDGET), 2, capture=False)
    assert not mixed.runs([object()] * 3, 3, {})
    with pytest.raises(ValueError, match="does not fit"):
        mixed.run([object()] * 3, [0, 1, 2], torch.zeros(3, dtype=torch.long),
                  torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))


def _staged_capture_state(tiny_model_dirs) -> MixedStepGraphs:
    """A CPU engine's whole-step graphs (fused ops) in the state capture() stages, not captured."""
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = LLM(path, device="cpu", dtype="float32", page_size=16, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=BUDGET, kv_cache_memory_bytes=1 << 24)
    llm.engine.runner.model.fused_ops = True
    mixed = MixedStepGraphs(llm.engine.runner, token_buckets(BUDGET), 4, capture=False)
    mixed.capture()
    return mixed


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the engine captures every bucket at "
                    "start-up (test_engine_tokens_equal_eager)")
def test_capture_state_runs_every_bucket(tiny_model_dirs):
    """The state the graphs are captured in (capture() stages it; the GPU then runs every
    bucket's forward once eagerly and once under capture) is valid for every bucket: no index
    out of range (the unused decode lanes' output row must exist in the smallest bucket)."""
    mixed = _staged_capture_state(tiny_model_dirs)
    with torch.inference_mode():
        for b in mixed.buckets:
            mixed._forward(b)
            assert torch.isfinite(mixed.logits).all()


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU run of the capture state (see "
                    "test_capture_state_runs_every_bucket)")
def test_capture_state_ignores_what_the_allocator_left(tiny_model_dirs, monkeypatch):
    """As test_capture_state_runs_every_bucket, with every torch.empty of the forward full of
    NaN (what a reused heap block held when an earlier test in the process freed NaN-filled
    tensors): no row that is read may come from memory nothing wrote. The padding rows' K/V
    land in the scratch slot that the unused decode lanes read (in the capture state: row 0,
    the sampled row)."""
    mixed = _staged_capture_state(tiny_model_dirs)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    with torch.inference_mode():
        for b in mixed.buckets:
            mixed._forward(b)
            assert torch.isfinite(mixed.logits).all(), f"bucket {b}"
