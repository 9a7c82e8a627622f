"""Two-tier prefill graphs (worker/two_tier_graphs.py): the sparseserve preset's layer segments
of slot-free prompts through one (layer, bucket) forward over static, bucket-padded buffers
must give the op-by-op path's tokens and logprobs and leave the same DRAM pages, summaries and
resident pages (the device slots' K / V of every page resident in each layer).

What runs through the graphs is asserted, not assumed: every slot-free chunk within the largest
bucket, in every layer interval of every step (several per step: one after another over the
same static buffers), and nothing else. The engine tests serve prompts of 1, 5, 17, 54, 97 and
33 tokens (the scheduler runs a 1-token prompt as a plain chunk, never slot-free: the step test
below runs one through the graphs), with decode rows beside the segments, segments of one layer,
a device cache smaller than the batch's pages (40 slots: prompts keep few or no pages resident),
the GPU's fused mapping forced on CPU tensors, buckets far above the prompts, and a largest
bucket below a prompt (97 tokens with buckets (32, 64): eager). The step test drives the runner
with hand-made steps: five slot-free prompts in one step (1 .. 97 tokens) with none / some /
all of their pages resident, segments ending and starting mid-model. On CPU tensors the layers
run uncaptured (Triton's interpreter for the fused kernels); on a GPU the engine captures them
itself under cudagraph_mode FULL (the last test)."""
import logging

import numpy as np
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.engine.sched_output import (NewRow, ScheduledChunk, SchedulerOutput,
                                             layer_intervals)
from sparseserve.engine.two_tier_graph_plan import captures_two_tier_graphs
from sparseserve.worker import two_tier_graphs as ttg
from sparseserve.worker.two_tier_graphs import TwoTierPrefillGraphs

from tests.conftest import DEVICE

LENS = (1, 17, 54, 97, 33, 5)
PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K + V of one page of the tiny GQA model, fp32
TOL = 1e-4 if DEVICE.type == "cpu" else 2e-3


def _llm(path, slots: int, host_pages: int = 400, **kw):
    args = dict(device=DEVICE.type, dtype="float32", page_size=16, max_model_len=256,
                max_num_seqs=4, max_num_batched_tokens=40, preset="sparseserve",
                token_budget=64, sink_pages=1, local_pages=1,
                kv_cache_memory_bytes=slots * PAGE_BYTES,
                kv_offloading_size=host_pages * PAGE_BYTES / 2**30,
                cudagraph_mode="FULL_DECODE_ONLY")  # (FULL, the GPU's default: captured)
    args.update(kw)
    return LLM(path, **args)


def _runs(chunk, max_tokens: int) -> bool:
    """What goes through the graphs (TwoTierPrefillGraphs.runs), for either run."""
    return (not chunk.is_decode and chunk.slot_free and chunk.start == 0
            and chunk.num_tokens <= max_tokens)


def _instrument(runner, graphs: bool, buckets=(32, 64, 128), fused=None):
    """Set the runner up for a comparison (fused path, zeroed tiers, the graphs built
    uncaptured where the engine did not capture them, or none) and record each step's graph
    runs: -> [(expected (tokens, a, b) runs, actual runs)] per step, filled as steps run."""
    if fused is not None:
        runner.offload.fused = fused
    runner.model.fused_ops = True  # the path the graphs run (compiled on a GPU)
    # pages and slots never written compare equal (allocated uninitialised on CPU)
    runner.offload._host.zero_()
    for t in runner.kv.k + runner.kv.v:
        t.zero_()
    if graphs:
        if runner.two_tier is None:  # built here, run uncaptured (no capture on CPU, none in
            # the default FULL_DECODE_ONLY on a GPU)
            runner.two_tier = TwoTierPrefillGraphs(runner, list(buckets), capture=False)
            runner.two_tier.capture()
        max_tokens = runner.two_tier.max_tokens
    else:
        runner.two_tier = None
        max_tokens = max(buckets)
    steps = []
    if graphs:
        run = runner.two_tier.run
        runner.two_tier.run = lambda h, c, a, b: steps[-1][1].append((h.shape[0], a, b)) or \
            run(h, c, a, b)
    eager = runner._run_eager

    def recorded(chunks, *args):
        want = [(c.num_tokens, a, b) for a, b in layer_intervals(chunks) for c in chunks
                if c.layer_start <= a and c.layer_end >= b and _runs(c, max_tokens)]
        steps.append((want, []))
        return eager(chunks, *args)
    runner._run_eager = recorded
    return steps


def _state(runner) -> dict:
    """The DRAM tier (every page but the scratch page, whose contents are garbage by design:
    padding lanes of the decode graphs and of these graphs write there, each their own), every
    summary, and per layer the resident pages with their slots' K / V (by page: the same pages
    must be resident, holding the same rows)."""
    cache = runner.offload
    cache.wait_saves()
    sp = cache.scratch_page
    resident = {}
    for layer in range(cache.num_layers):
        page_of = cache.page_of[layer, :cache.num_slots]
        slots = torch.nonzero(page_of >= 0).flatten()
        pages, order = torch.sort(page_of[slots])
        slots = slots[order]
        resident[layer] = (pages.cpu(), cache.dev_k[layer][slots].cpu(),
                           cache.dev_v[layer][slots].cpu())
    return {"host": cache._host[:, :, :sp].clone(), "resident": resident, "summaries": {
        (layer, name): t[:sp].clone() for layer, s in enumerate(runner.sparse.summaries)
        for name, t in s.tensors.items()}}


def _same_state(got: dict, want: dict, tol: float = TOL) -> None:
    torch.testing.assert_close(got["host"], want["host"], rtol=tol, atol=tol)
    for key, t in want["summaries"].items():
        torch.testing.assert_close(got["summaries"][key], t, rtol=tol, atol=tol)
    for layer, (pages, k, v) in want["resident"].items():
        g_pages, g_k, g_v = got["resident"][layer]
        assert torch.equal(g_pages, pages), f"layer {layer}: other pages resident"
        torch.testing.assert_close(g_k, k, rtol=tol, atol=tol)
        torch.testing.assert_close(g_v, v, rtol=tol, atol=tol)


def _prompts(lens):
    return [{"prompt_token_ids": [3 + (j * (i + 7)) % 300 for j in range(n)]}
            for i, n in enumerate(lens)]


def _generate(path, graphs: bool, slots: int, buckets=(32, 64, 128), fused=None,
              lens=LENS, **kw):
    llm = _llm(path, slots, **kw)
    runner = llm.engine.runner
    steps = _instrument(runner, graphs, buckets, fused)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = llm.generate(_prompts(lens), params, use_tqdm=False)
    llm.engine.check_invariants()
    return ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], steps,
            _state(runner))


def _same(got, want, tol=TOL):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want):
        for g, w in zip(lp_got, lp_want):  # per token {id: Logprob}: same ids, close values
            assert g.keys() == w.keys()
            for tok in g:
                assert abs(g[tok].logprob - w[tok].logprob) < tol


def _graph_runs(steps) -> list[tuple[int, int, int]]:
    """Every step ran exactly the expected graph runs -> all of them."""
    for want, got in steps:
        assert got == want, "a slot-free chunk ran eagerly (or something else ran here)"
    return [r for _, got in steps for r in got]


@pytest.mark.parametrize("slots,fused", [(400, False), (40, False), (400, True), (40, True)])
def test_engine_tokens_equal_eager(tiny_model_dirs, slots, fused):
    """Layer segments of slot-free prompts through the graph layers == op by op: tokens and
    logprobs, the DRAM tier's K / V, every page summary and the resident pages' slots. 400
    slots: prompts keep their pages resident (mapped and stored); 40: fewer slots than the
    batch's pages (evicting). `fused`: the GPU's mapping (every layer of a segment at once,
    the fused retrieve kernels), forced on CPU tensors (Triton's interpreter) in both runs."""
    path, _ = tiny_model_dirs["llama-gqa"]
    want, want_steps, want_state = _generate(path, False, slots, fused=fused)
    got, steps, got_state = _generate(path, True, slots, fused=fused)
    _same(got, want)
    runs = _graph_runs(steps)
    # the same steps were scheduled in both runs
    assert [w for w, _ in steps] == [w for w, _ in want_steps]
    # every prompt but the 1-token one (never slot-free), through each of the 3 layers once
    layers = {n: sum(b - a for t, a, b in runs if t == n) for n in LENS}
    assert layers == {n: 3 if n > 1 else 0 for n in LENS}, runs
    assert any(b - a == 1 for t, a, b in runs if t == 97), "no segment of one layer"
    assert any(len(got) > 1 and len({(a, b) for _, a, b in got}) < len(got)
               for _, got in steps), "no layer interval with several slot-free prompts"
    _same_state(got_state, want_state)


def test_padding_rows_touch_nothing(tiny_model_dirs):
    """Buckets far above the prompts (every step padded by 100+ rows): the same tokens, DRAM
    pages, summaries and resident slots as op by op (padding rows save to no page, store into
    the scratch slot, complete no page); their stream stays zero between the layers."""
    path, _ = tiny_model_dirs["llama-gqa"]
    want, _, want_state = _generate(path, False, 400)
    got, steps, got_state = _generate(path, True, 400, buckets=(224,))
    _same(got, want)
    runs = _graph_runs(steps)
    assert runs and all(t < 224 for t, _, _ in runs)
    _same_state(got_state, want_state)


def test_prompt_above_the_largest_bucket_runs_eagerly(tiny_model_dirs):
    """Buckets (32, 64): the 97-token prompt's segments run op by op beside the others'
    graphs, with the same results."""
    path, _ = tiny_model_dirs["llama-gqa"]
    want, _, want_state = _generate(path, False, 400, buckets=(32, 64))
    got, steps, got_state = _generate(path, True, 400, buckets=(32, 64))
    _same(got, want)
    lens = {t for t, _, _ in _graph_runs(steps)}
    assert lens == {5, 17, 54, 33}, lens
    _same_state(got_state, want_state)


# ---- hand-made steps: several slot-free prompts in one step --------------------------------

class _InFlight:
    """A copy event that never completes; nothing may wait on it."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("the host waited for a staging copy")

    wait = synchronize


def _steps(runner, scheduler):
    """Two steps of slot-free prompts (request id, tokens, layers, resident pages per KV
    head): step 1 runs five of them, in three layer intervals; step 2 finishes two that
    stopped mid-model beside a new one. -> the SchedulerOutputs, made as the scheduler would
    (pages from its allocator)."""
    L = runner.num_layers
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    plan = [[("a", 1, 0, L, 0),     # one token: no page resident (first == nb)
             ("b", 5, 0, L, 1),     # under a page, all of it resident (first == 0)
             ("c", 17, 0, 1, 2),    # all resident, stops after layer 0
             ("d", 54, 0, 2, 1),    # its partial last page resident, the rest not
             ("e", 97, 0, L, 0)],   # 7 pages, none resident
            [("c", 17, 1, L, 2), ("d", 54, 2, L, 1), ("f", 33, 0, L, 3)]]
    rows: dict[str, int] = {}
    outs = []
    for step in plan:
        chunks, new_rows = [], []
        for rid, n, l0, l1, resident in step:
            first, new = 0, np.empty((0, runner.num_kv_heads), np.int32)
            if rid not in rows:
                rows[rid] = len(rows)
                new_rows.append(NewRow(rows[rid], rid, params))
                first, new = scheduler.kv.allocate(rid, n)
            tokens = [3 + (j * (len(rid) + ord(rid))) % 300 for j in range(n)]
            chunks.append(ScheduledChunk(
                request_id=rid, row=rows[rid], token_ids=tokens, start=0, layer_start=l0,
                layer_end=l1, sample=l1 == L, num_output_tokens=0, slot_free=True,
                first_new_chunk=first, new_chunks=new, resident_pages=resident))
        outs.append(SchedulerOutput(chunks=chunks, new_rows=new_rows, num_layers=L))
    return outs


def _run_steps(path, graphs: bool, in_flight: bool = False):
    llm = _llm(path, 400, max_num_seqs=8)
    runner = llm.engine.runner
    runner.keep_logits = True
    steps = _instrument(runner, graphs)
    if in_flight:  # every staging copy still in flight: the ring must grow, never wait
        runner.two_tier._copy_event = _InFlight
    results = []
    for out in _steps(runner, llm.engine.scheduler):
        res = runner.execute(out)
        results.append((res.token_ids, res.logits.clone(),
                        {rid: h.clone() for rid, h in runner.saved_hidden.items()}))
    runner.offload.check_invariants()
    return results, steps, _state(runner), runner


def test_several_slot_free_prompts_in_a_step(tiny_model_dirs):
    """Five slot-free prompts (1, 5, 17, 54, 97 tokens) in one step, their segments ending at
    different layers, then two of them finishing beside a new prompt: each prompt of each
    layer interval runs through the graphs, one after another over the same static buffers
    (with every staging copy still in flight: the ring grows instead of waiting), and the
    logits, the hidden states kept between segments, DRAM pages, summaries and resident
    slots equal the op-by-op step's."""
    path, _ = tiny_model_dirs["llama-gqa"]
    want, _, want_state, _ = _run_steps(path, False)
    got, steps, got_state, runner = _run_steps(path, True, in_flight=True)
    runs = _graph_runs(steps)
    assert [r for r in steps[0][1]] == [(1, 0, 1), (5, 0, 1), (17, 0, 1), (54, 0, 1),
                                        (97, 0, 1), (1, 1, 2), (5, 1, 2), (54, 1, 2),
                                        (97, 1, 2), (1, 2, 3), (5, 2, 3), (97, 2, 3)]
    assert sorted(steps[1][1]) == [(17, 1, 2), (17, 2, 3), (33, 0, 1), (33, 1, 2), (33, 2, 3),
                                   (54, 2, 3)]
    # no buffer was reused while its copy was in flight: one per run (the capture's is free)
    assert len(runner.two_tier.staging.buffers) == len(runs)
    for (g_tok, g_logits, g_hidden), (w_tok, w_logits, w_hidden) in zip(got, want):
        assert g_tok == w_tok
        torch.testing.assert_close(g_logits, w_logits, rtol=TOL, atol=TOL)
        assert g_hidden.keys() == w_hidden.keys()
        for rid, h in w_hidden.items():
            torch.testing.assert_close(g_hidden[rid], h, rtol=TOL, atol=TOL)
    assert len(want_state["resident"][0][0]) > 0, "no page kept resident"
    _same_state(got_state, want_state)


def test_longer_prompts_run_eagerly(tiny_model_dirs):
    """A prompt above the largest bucket is not run here (runs() is False), a chunk that
    continues a prefix neither; run() refuses both."""
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = _llm(path, 400)
    runner = llm.engine.runner
    tt = TwoTierPrefillGraphs(runner, [32], capture=False)
    mk = lambda n, start, free: ScheduledChunk(  # noqa: E731
        request_id="r", row=0, token_ids=[5] * n, start=start, layer_start=0, layer_end=1,
        sample=False, num_output_tokens=0, slot_free=free)
    assert tt.runs(mk(32, 0, True)) and not tt.runs(mk(33, 0, True))
    assert not tt.runs(mk(8, 16, False)) and not tt.runs(mk(8, 0, False))
    with pytest.raises(ValueError):
        tt.run(torch.zeros(33, runner.cfg.model.hidden_size), mk(33, 0, True), 0, 1)


def test_flash_retry_only_for_capture_failures(tiny_model_dirs, monkeypatch, caplog):
    """A failed capture with cuDNN's attention is retried with flash's, the error logged
    whole; out of memory is not retried (capture_two_tier_graphs falls back to eager)."""
    path, _ = tiny_model_dirs["llama-gqa"]
    runner = _llm(path, 400).engine.runner
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    attempts = []

    def failing(error):
        def capture_all(keys, forward):
            attempts.append(error)
            if error is not None and len(attempts) == 1:
                raise error
            return {}, {}, None
        return capture_all

    for error, retried in [(RuntimeError("CUDA error: operation not permitted when stream "
                                         "is capturing\nsecond line"), True),
                           (torch.OutOfMemoryError("CUDA out of memory"), False)]:
        attempts.clear()
        tt = TwoTierPrefillGraphs(runner, [32], capture=False)
        tt.capture_graphs, tt.prefill_attn = True, object()
        monkeypatch.setattr(ttg, "capture_all", failing(error))
        with caplog.at_level(logging.WARNING, logger="sparseserve"):
            if retried:
                tt.capture()
                assert len(attempts) == 2 and tt.prefill_attn is None
                assert "RuntimeError: CUDA error: operation not permitted when stream is " \
                    "capturing\nsecond line" in caplog.text
            else:
                with pytest.raises(torch.OutOfMemoryError):
                    tt.capture()
                assert len(attempts) == 1 and tt.prefill_attn is not None


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
    start-up (max_model_len 1024, the tiny model's positions: buckets 512, 1024), every
    slot-free prompt's segments
    replay them (prompts in two buckets), tokens, logprobs, DRAM pages and summaries ==
    FULL_DECODE_ONLY's eager segments."""
    path, _ = tiny_model_dirs["llama-gqa"]
    lens = LENS + (700,)
    kw = dict(max_model_len=1024, max_inject_tokens=2200, host_pages=1600)
    out, state, runs = {}, {}, {}
    for mode in ("FULL_DECODE_ONLY", "FULL"):
        llm = _llm(path, 400, cudagraph_mode=mode, **kw)
        runner = llm.engine.runner
        tt = runner.two_tier
        if mode == "FULL":
            assert tt is not None and tt.buckets == [512, 1024]
            assert len(tt.graphs) == len(tt.buckets) * tt.num_layers
        else:
            assert tt is None
        steps = _instrument(runner, mode == "FULL", buckets=(512, 1024))
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
        outs = llm.generate(_prompts(lens), params, use_tqdm=False)
        out[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        llm.engine.check_invariants()
        state[mode] = _state(runner)  # waits for the saves
        runs[mode] = steps
        del llm, runner, tt
    _same(out["FULL"], out["FULL_DECODE_ONLY"], 2e-3)
    got = _graph_runs(runs["FULL"])
    assert {t for t, _, _ in got} == {n for n in lens if n > 1}
    assert {t for t, _, _ in got if t > 512} == {700}  # the second bucket replayed
    _same_state(state["FULL"], state["FULL_DECODE_ONLY"], 2e-3)
