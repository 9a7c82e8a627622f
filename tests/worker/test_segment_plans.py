"""A layer-segmented prompt's host plans shared by its segment steps (worker/segment_plans.py).

* Equivalence: the tiny sparseserve engine (3 layers, prompts of 5, 17, 54, 97 and 300 tokens:
  segments of one to three layers, the 300-token prompt chunked at the injection budget, decode
  rows beside the segments) gives the same tokens, logprobs, DRAM tier, summaries and resident
  pages with the per-request plans as with every step building its own; for slot-free prompts
  (GPU-direct saves), mapped ones (FlashD2H) and the per-page baseline (memcpy: the decode
  rows' destinations in the step's save plan), with few device slots and with the fused
  mapping (every layer of a segment at once), and with the scheduler keeping other numbers of
  a slot-free prompt's pages resident at its segment steps (compared: the pages resident after
  every step).
* Scaling guard: no segment step after a chunk's first builds its plans again (the builders'
  calls counted per batch row); a new chunk, a changed directory, other resident pages, a gap
  in its layers or a released (preempted) request builds afresh.
* No leak: nothing is kept once every request finished, nor after an abort mid-segment.
"""
import numpy as np
import pytest
import torch

from sparseserve import SamplingParams
from sparseserve.engine.sched_output import ScheduledChunk
from sparseserve.worker.offload_cache import TwoTierCache
from sparseserve.worker.offload_context import OffloadForwardContext
from sparseserve.worker.page_directory import PageDirectory
from sparseserve.worker.segment_plans import SegmentPlans
from tests.worker.test_two_tier_graphs import _instrument, _llm, _prompts, _same, _same_state, \
    _state

LENS = (5, 17, 54, 97, 300)
KW = dict(max_model_len=512, host_pages=800)


def _generate(path, shared: bool, slots: int = 400, fused=None, vary=False, **kw):
    llm = _llm(path, slots, **{**KW, **kw})
    runner = llm.engine.runner
    if vary:  # slot-free prompts keep fewer pages resident at odd layers (the scheduler may
        # give other numbers at each segment step: a plan of the old number must not be used)
        sched = llm.engine.scheduler
        keep = sched._keep_prompt_pages_resident

        def varied(chunks):
            keep(chunks)
            for c in chunks:
                if c.slot_free and c.layer_start % 2:
                    c.resident_pages //= 2
        sched._keep_prompt_pages_resident = varied
    _instrument(runner, False, fused=fused)
    if not shared:  # every step builds its own plans (the code before the per-request cache)
        runner.segment_plans.for_step = lambda chunks: {}
    resident = []  # after each step, per layer, the resident pages (none is left at the end)
    forward = runner._forward_step

    def recorded(out):
        r = forward(out)
        page_of = runner.offload.page_of[:, :runner.offload.num_slots]
        resident.append([sorted(p[p >= 0].tolist()) for p in page_of])
        return r
    runner._forward_step = recorded
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate(_prompts(LENS), params, use_tqdm=False)
    llm.engine.check_invariants()
    assert runner.segment_plans.entries == {}, "plans kept after every request finished"
    return ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
            dict(_state(runner), steps=resident), runner.segment_plans)


@pytest.mark.parametrize("slots,fused,d2h,vary", [
    (400, None, None, False), (70, None, None, False), (400, True, None, False),
    (400, None, "flash", False), (70, None, "memcpy", False), (400, None, None, True)])
def test_shared_plans_change_nothing(tiny_model_dirs, slots, fused, d2h, vary):
    path, _ = tiny_model_dirs["llama-gqa"]
    kw = {} if d2h is None else dict(d2h_method=d2h)
    want, want_state, _ = _generate(path, False, slots, fused, vary, **kw)
    got, got_state, plans = _generate(path, True, slots, fused, vary, **kw)
    assert plans.hits > 0 and plans.builds > 0, "no segment step reused its chunk's plans"
    _same(got, want)
    _same_state(got_state, want_state)
    assert got_state["steps"] == want_state["steps"], "other pages resident after a step"


def test_later_segment_steps_build_nothing(tiny_model_dirs, monkeypatch):
    """Per step and batch row, the calls of the plan builders: a chunk's first segment step
    builds its prefill plan and save destinations (once), its later segment steps none."""
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = _llm(path, 400, **KW)
    runner = llm.engine.runner
    calls: list[tuple[str, int]] = []

    def counted(name, fn, row_of):
        def wrapper(*a, **k):
            calls.append((name, row_of(*a, **k)))
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(OffloadForwardContext, "_chunk_prefill_plan", counted(
        "prefill", OffloadForwardContext._chunk_prefill_plan, lambda self, p: p.row))
    monkeypatch.setattr(PageDirectory, "host_pages_span", counted(
        "span", PageDirectory.host_pages_span, lambda self, row, *a: row))
    monkeypatch.setattr(TwoTierCache, "save_plan", counted(
        "save_plan", TwoTierCache.save_plan, lambda self, pages, *a, **k: len(pages)))
    steps = []  # (prefill chunks (row, start, tokens, layers, first-of-chunk), calls)
    forward = runner._forward_step

    def recorded(out):
        calls.clear()
        r = forward(out)
        chunks = [(c.row, c.start, c.num_tokens, c.layer_start, c.layer_end)
                  for c in out.chunks if not c.is_decode]
        steps.append((chunks, list(calls)))
        return r
    runner._forward_step = recorded
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(_prompts(LENS), params, use_tqdm=False)
    later = [(ch, c) for ch, c in steps if ch and all(l0 > 0 for _, _, _, l0, _ in ch)]
    first = [(ch, c) for ch, c in steps if any(l0 == 0 and l1 < 3 for *_, l0, l1 in ch)]
    assert len(later) >= 5 and first
    for chunks, c in later:  # every prefill chunk of the step past its first segment
        assert not [x for x in c if x[0] in ("prefill", "span")], (chunks, c)
    for chunks, c in first:  # a chunk's first segment builds (and later ones reuse it)
        for row, _, n, l0, l1 in chunks:
            if l0 == 0 and l1 < 3:
                assert ("prefill", row) in c and ("span", row) in c, (chunks, c)
    # one prefill plan and span per chunk of a prompt (the 300-token one is three chunks)
    chunks = {(r, s, n) for ch, _ in steps for r, s, n, _, l1 in ch}
    for name in ("prefill", "span"):
        assert len([1 for _, c in steps for x in c if x[0] == name]) == len(chunks), name
    # a step's saved rows one chunk's alone (the decode rows' saves are GPU-direct): its save
    # plan built at most once a chunk, and reused by its later steps alone
    alone: dict = {}
    for ch, c in steps:
        if len(ch) == 1:
            alone.setdefault(ch[0][:3], []).append([x for x in c if x[0] == "save_plan"])
    assert all(sum(map(len, built)) <= 1 for built in alone.values()), alone
    assert sum(len(built) - 1 for built in alone.values()) >= 3, alone


def _chunk(rid="a", row=1, start=0, n=54, l0=0, l1=1, resident=0, new=0):
    return ScheduledChunk(request_id=rid, row=row, token_ids=[7] * n, start=start,
                          layer_start=l0, layer_end=l1, sample=n == 1, num_output_tokens=0,
                          slot_free=start == 0, resident_pages=resident,
                          new_chunks=np.zeros((new, 2), np.int32))


def test_entry_rebuilt_whenever_its_inputs_change():
    d = PageDirectory(rows=4, num_kv_heads=2, max_blocks=64, chunk_pages=4, scratch_page=999,
                      device=torch.device("cpu"))
    d.chunks_np[1] = [[3, 4, 5] + [0] * 13, [6, 7, 8] + [0] * 13]
    sp = SegmentPlans(d, page_size=16, num_layers=4)
    e = sp.for_step([_chunk(new=1)])["a"]
    assert sp.for_step([_chunk(l0=1, l1=2)])["a"] is e  # the next segment: reused
    assert sp.for_step([_chunk(l0=2, l1=3)])["a"] is e and (sp.builds, sp.hits) == (1, 2)
    for changed in (dict(resident=2), dict(row=2), dict(start=16), dict(n=53),
                    dict(new=1), dict(rid="b")):
        sp.for_step([_chunk(l0=0, l1=1)])  # a fresh entry, then its next segment changed
        builds = sp.builds
        sp.for_step([_chunk(l0=1, l1=2, **changed)])
        assert sp.builds == builds + 1, changed
    sp.for_step([_chunk(l0=0, l1=1)])
    builds = sp.builds
    sp.for_step([_chunk(l0=2, l1=3)])  # a gap in the layers
    assert sp.builds == builds + 1
    e = sp.for_step([_chunk(l0=3, l1=4)])["a"]  # the last segment: used, not kept
    assert "a" not in sp.entries and e is not None
    sp.for_step([_chunk(l0=0, l1=1)])
    d.chunks_np[1, 1, 0] = 9  # the directory changed under the chunk's pages (blocks 0-3)
    builds = sp.builds
    sp.for_step([_chunk(l0=1, l1=2)])
    assert sp.builds == builds + 1
    d.chunks_np[1, 1, 5] = 9  # ... past them: reused
    sp.for_step([_chunk(l0=2, l1=3)])
    assert sp.builds == builds + 1
    sp.release(["a", "b"])  # finished / aborted / preempted
    assert sp.entries == {}
    sp.for_step([_chunk(l0=3, l1=4)])  # a resumed request's segment after release: fresh
    assert sp.builds == builds + 2
    # decode rows get none, a chunk of all the layers a fresh one for its step alone
    got = sp.for_step([_chunk(l0=0, l1=4), _chunk(rid="d", start=60, n=1, l1=4)])
    assert list(got) == ["a"] and sp.builds == builds + 3 and sp.entries == {}


def test_abort_mid_segment_drops_the_entry(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = _llm(path, 400, **KW)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("long", _prompts([97])[0], params)
    engine.add_request("short", _prompts([5])[0], params)
    for _ in range(20):
        engine.step()
        if "long" in runner.segment_plans.entries:
            break
    assert "long" in runner.segment_plans.entries, "the 97-token prompt never segmented"
    engine.abort_request("long")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("next", _prompts([5])[0], params)  # a step after the abort's
    while engine.has_unfinished_requests():
        engine.step()
    assert runner.segment_plans.entries == {}
    assert "long" not in runner.saved_hidden
