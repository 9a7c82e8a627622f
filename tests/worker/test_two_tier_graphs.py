"""Two-tier prefill graphs (worker/two_tier_graphs.py): the sparseserve preset's layer segments
of slot-free prompts through one (layer, bucket) forward over static, bucket-padded buffers
must give the op-by-op path's tokens and logprobs — odd prompt lengths (1, 17, 54, 97: below a
page, off page boundaries), segments that start and end mid-model, decode rows beside them, a
device cache smaller than the batch (prompts keep few or no pages resident) — and leave the
same DRAM pages, summaries and residency. On CPU tensors the layers run uncaptured (Triton's
interpreter for the fused kernels); on a GPU the engine captures them itself under
cudagraph_mode FULL."""
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.engine.two_tier_graph_plan import captures_two_tier_graphs
from sparseserve.worker.two_tier_graphs import TwoTierPrefillGraphs

from tests.conftest import DEVICE

LENS = (1, 17, 54, 97, 33, 5)
PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K + V of one page of the tiny GQA model, fp32


def _llm(path, slots: int, **kw):
    return LLM(path, device=DEVICE.type, dtype="float32", page_size=16, max_model_len=256,
               max_num_seqs=4, max_num_batched_tokens=40, preset="sparseserve",
               token_budget=64, sink_pages=1, local_pages=1,
               kv_cache_memory_bytes=slots * PAGE_BYTES,
               kv_offloading_size=400 * PAGE_BYTES / 2**30, **kw)


def _generate(path, graphs: bool, slots: int, buckets=(32, 64, 128), fused=None, **kw):
    llm = _llm(path, slots, **kw)
    runner = llm.engine.runner
    if fused is not None:
        runner.offload.fused = fused
    runner.model.fused_ops = True  # the path the graphs run (compiled on a GPU)
    runner.offload._host.zero_()  # pages never written compare equal (allocated uninitialised)
    if graphs:
        if runner.two_tier is None:  # built here, run uncaptured (no capture on CPU, none in
            # the default FULL_DECODE_ONLY on a GPU)
            runner.two_tier = TwoTierPrefillGraphs(runner, list(buckets), capture=False)
            runner.two_tier.capture()
    else:
        runner.two_tier = None
    calls = []
    if graphs:
        run = runner.two_tier.run
        runner.two_tier.run = lambda h, c, a, b: calls.append((h.shape[0], a, b)) or \
            run(h, c, a, b)
    prompts = [{"prompt_token_ids": [3 + (j * (i + 7)) % 300 for j in range(n)]}
               for i, n in enumerate(LENS)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_invariants()
    cache = runner.offload
    cache.wait_saves()
    # every page but the scratch page, whose contents are garbage by design (padding lanes of
    # the decode graphs and of these graphs write there, each their own)
    sp = cache.scratch_page
    state = {"host_k": cache._host[:, :, :sp].clone(), "summaries": {
        (layer, name): t[:sp].clone() for layer, s in enumerate(runner.sparse.summaries)
        for name, t in s.tensors.items()}}
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls, state


def _same(got, want, tol):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want):
        for g, w in zip(lp_got, lp_want):  # per token {id: Logprob}: same ids, close values
            assert g.keys() == w.keys()
            for tok in g:
                assert abs(g[tok].logprob - w[tok].logprob) < tol


@pytest.mark.parametrize("slots,fused", [(400, False), (40, False), (400, True)])
def test_engine_tokens_equal_eager(tiny_model_dirs, slots, fused):
    """Layer segments of slot-free prompts through the graph layers == op by op: tokens and
    logprobs, the DRAM tier's K / V and every page summary. 400 slots: prompts keep their
    pages resident (mapped and stored); 40: fewer slots than the batch's pages. `fused`: the
    GPU's mapping (every layer of a segment at once, the fused retrieve kernels), forced on
    CPU tensors (Triton's interpreter) in both runs."""
    path, _ = tiny_model_dirs["llama-gqa"]
    want, _, want_state = _generate(path, False, slots, fused=fused)
    got, calls, got_state = _generate(path, True, slots, fused=fused)
    tol = 1e-4 if DEVICE.type == "cpu" else 2e-3
    _same(got, want, tol)
    assert calls, "no layer segment went through the two-tier graphs"
    assert any(t > 1 and b - a < 2 for t, a, b in calls), "no segment of fewer layers"
    assert any(t % 16 for t, _, _ in calls), "no prompt off a page boundary"
    torch.testing.assert_close(got_state["host_k"], want_state["host_k"], rtol=tol, atol=tol)
    for key, t in want_state["summaries"].items():
        torch.testing.assert_close(got_state["summaries"][key], t, rtol=tol, atol=tol)


def test_padding_rows_touch_nothing(tiny_model_dirs):
    """Buckets far above the prompts (every step padded by 100+ rows): the same tokens and
    DRAM pages as op by op (padding rows save to no page and complete no page)."""
    path, _ = tiny_model_dirs["llama-gqa"]
    want, _, want_state = _generate(path, False, 400)
    got, calls, got_state = _generate(path, True, 400, buckets=(224,))
    _same(got, want, 1e-4 if DEVICE.type == "cpu" else 2e-3)
    assert calls and all(t < 224 for t, _, _ in calls)
    torch.testing.assert_close(got_state["host_k"], want_state["host_k"])


def test_longer_prompts_run_eagerly(tiny_model_dirs):
    """A prompt above the largest bucket is not run here (runs() is False), a chunk that
    continues a prefix neither; run() refuses both."""
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = _llm(path, 400)
    runner = llm.engine.runner
    tt = TwoTierPrefillGraphs(runner, [32], capture=False)
    from sparseserve.engine.sched_output import ScheduledChunk
    mk = lambda n, start, free: ScheduledChunk(  # noqa: E731
        request_id="r", row=0, token_ids=[5] * n, start=start, layer_start=0, layer_end=1,
        sample=False, num_output_tokens=0, slot_free=free)
    assert tt.runs(mk(32, 0, True)) and not tt.runs(mk(33, 0, True))
    assert not tt.runs(mk(8, 16, False)) and not tt.runs(mk(8, 0, False))
    with pytest.raises(ValueError):
        tt.run(torch.zeros(33, runner.cfg.model.hidden_size), mk(33, 0, True), 0, 1)


def test_captured_only_for_the_sparseserve_preset_in_full_mode(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    cfg = _llm(path, 400).engine.config
    assert not captures_two_tier_graphs(cfg)  # FULL_DECODE_ONLY (and no GPU here)
    from dataclasses import replace
    full = replace(cfg, device="cuda", cudagraph_mode="FULL")
    assert captures_two_tier_graphs(full)
    assert not captures_two_tier_graphs(replace(full, enforce_eager=True))
    assert not captures_two_tier_graphs(replace(full, cache=replace(full.cache,
                                                                    d2h_method="flash")))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="captures CUDA graphs")
def test_engine_captures_two_tier_graphs_on_gpu(tiny_model_dirs):
    """cudagraph_mode FULL with the sparseserve preset: every (layer, bucket) captured at
    start-up, layer segments replay them, tokens == FULL_DECODE_ONLY's (eager segments)."""
    path, _ = tiny_model_dirs["llama-gqa"]
    prompts = [{"prompt_token_ids": [3 + (j * (i + 7)) % 300 for j in range(n)]}
               for i, n in enumerate(LENS)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    out = {}
    for mode in ("FULL_DECODE_ONLY", "FULL"):
        llm = _llm(path, 400, cudagraph_mode=mode)
        tt = llm.engine.runner.two_tier
        seen = []
        if mode == "FULL":
            assert tt is not None and len(tt.graphs) == len(tt.buckets) * tt.num_layers
            run = tt.run
            tt.run = lambda h, c, a, b: seen.append(h.shape[0]) or run(h, c, a, b)
        else:
            assert tt is None
        outs = llm.generate(prompts, params, use_tqdm=False)
        out[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        llm.engine.check_invariants()
        if mode == "FULL":
            assert seen
        del llm
    _same(out["FULL"], out["FULL_DECODE_ONLY"], 2e-3)
