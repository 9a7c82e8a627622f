"""The two-tier cache as a system (CPU mode): offloaded prefill keeps its KV in device slots,
working-set-aware batch control bounds what a step admits, requests that wait for slots resume
without recompute, layer-segmented prefill over the two tiers, presets."""
import random

import pytest

from sparseserve import LLM, SamplingParams

PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K+V, 3 layers, page_size 16, head_dim 16, fp32
# the CPU engine (both tiers in CPU memory, exact fp32): tests/gpu covers the GPU
SPARSE = dict(page_size=16, sparse_algorithm="arkvale", token_budget=64, sink_pages=1,
              local_pages=1, max_num_seqs=12, max_model_len=256, device="cpu")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


def prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in lengths]


def offload_llm(model_dir, slots, **kw):
    args = dict(SPARSE, kv_offload=True, kv_cache_memory_bytes=slots * PAGE_BYTES,
                kv_offloading_size=800 * PAGE_BYTES / 2**30)
    args.update(kw)
    return LLM(model_dir, **args)


def greedy(n=20):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def resident(model_dir, ps, params, **kw):
    return tokens(LLM(model_dir, **dict(SPARSE, **kw)).generate(ps, params, use_tqdm=False))


LENGTHS = [1, 17, 54, 97, 130]


@pytest.mark.parametrize("mode", [dict(max_num_batched_tokens=13),
                                  dict(max_num_batched_tokens=64, max_inject_tokens=100)],
                         ids=["chunked", "layer-segmented"])
def test_offloaded_prefill_reads_nothing_from_dram_that_is_in_hbm(model_dir, mode):
    """A roomy device cache: every chunk finds its prefix in slots and decode starts warm, so
    not one page is loaded from DRAM, and the tokens equal the all-resident sparse engine."""
    ps = prompts(LENGTHS)
    ref = resident(model_dir, ps, greedy())
    llm = offload_llm(model_dir, 400, **mode)
    assert tokens(llm.generate(ps, greedy(), use_tqdm=False)) == ref
    stats = llm.engine.get_stats()
    assert stats["pages_loaded_total"] == 0 and stats["bytes_loaded_total"] == 0
    assert stats["cache_misses_total"] == 0 and stats["cache_hits_total"] > 0
    # the prefix of every later chunk was found resident (a prefill hit)
    if "max_inject_tokens" not in mode:
        assert stats["prefill_cache_hits_total"] > 0
    assert stats["bytes_saved_total"] > 0
    llm.engine.check_invariants()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


def run_stepwise(llm, ps, params):
    """Step by hand; -> (outputs by request, per-step records of the scheduler's plan)."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(str(i), p, sp)
    done, steps = {}, []
    sched = eng.scheduler
    loaded0 = eng.get_stats()["pages_loaded_total"]
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        loaded = eng.get_stats()["pages_loaded_total"]
        steps.append({"ws": sched.estimated_working_set, "waiting": sched.num_waiting_for_slots,
                      "loaded": loaded - loaded0})
        loaded0 = loaded
        eng.check_invariants()
    return [done[str(i)] for i in range(len(ps))], steps


def test_working_set_control_bounds_admission_and_cuts_loads(model_dir):
    """12 requests of 97-130 tokens (7-9 pages per head, 4 selected per step) on 48 slots:
    without control the scheduler runs every request whose mandatory pages fit (thrashing);
    with it, admitted working sets stay within M_avl and fewer pages are loaded per step.
    Both give the all-resident tokens; nothing is recomputed and nothing leaks."""
    lengths = [97 + 3 * i for i in range(12)]
    ps = prompts(lengths, seed=3)
    params = [greedy(24)] * len(ps)
    ref = resident(model_dir, ps, params)
    runs = {}
    for control in (False, True):
        llm = offload_llm(model_dir, 48, working_set_control=control, max_num_batched_tokens=64)
        outs, steps = run_stepwise(llm, ps, params)
        assert outs == ref
        budget = llm.engine.scheduler.slots
        assert all(s["ws"] <= budget.num_slots - budget.reserve for s in steps)
        assert llm.engine.scheduler.num_preemptions_total == 0  # waits, never recomputes
        assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
        assert int((llm.engine.runner.offload.page_of[:, :-1] >= 0).sum()) == 0
        runs[control] = steps
    per_step = {c: sum(s["loaded"] for s in st) / len(st) for c, st in runs.items()}
    assert per_step[True] < per_step[False]
    assert any(s["waiting"] for s in runs[True])  # control made requests wait for slots


def test_waiting_for_slots_and_resumed_equals_uninterrupted(model_dir):
    """A cache that holds two working sets: the other requests wait (their DRAM pages stay)
    and resume later; the tokens equal an uninterrupted resident run, logprobs too."""
    ps = prompts([130, 129, 97, 54], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    ref_llm = LLM(model_dir, **dict(SPARSE, max_num_seqs=1))
    ref = ref_llm.generate(ps, params, use_tqdm=False)
    llm = offload_llm(model_dir, 40, max_num_batched_tokens=300)
    outs = llm.generate(ps, params, use_tqdm=False)
    assert tokens(outs) == tokens(ref)
    for a, b in zip(outs, ref):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in y:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)
    assert llm.engine.scheduler.num_preemptions_total == 0
    assert sum(o.metrics.num_preemptions for o in outs) == 0


def test_full_host_tier_still_preempts_by_recompute(model_dir):
    """Recompute is left only for a full host tier: every request still finishes."""
    ps = prompts([250, 249, 248, 247], seed=9)
    # 8 chunks of 16 pages (256 tokens of one head): the four prompts fit (2 chunks each),
    # but growing past 256 tokens needs 2 more chunks per request
    llm = offload_llm(model_dir, 64, kv_offloading_size=128 * PAGE_BYTES / 2**30,
                      max_num_batched_tokens=64, max_model_len=512)
    outs = llm.generate(ps, greedy(40), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.engine.scheduler.num_preemptions_total > 0
    llm.engine.check_invariants()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


@pytest.mark.parametrize("preset", ["dense", "sparse", "sparse-offload", "sparseserve"])
def test_each_preset_builds_and_runs(model_dir, preset):
    kw = dict(page_size=16, token_budget=64, sink_pages=1, local_pages=1, max_num_seqs=4,
              max_model_len=256, device="cpu")
    if preset.endswith("offload") or preset == "sparseserve":
        kw.update(kv_cache_memory_bytes=64 * PAGE_BYTES,
                  kv_offloading_size=200 * PAGE_BYTES / 2**30)
    llm = LLM(model_dir, preset=preset, **kw)
    cfg = llm.engine.config
    assert cfg.sparse.enabled == (preset != "dense")
    assert cfg.cache.kv_offload == (preset in ("sparse-offload", "sparseserve"))
    if preset == "sparse-offload":
        assert (cfg.cache.h2d_method, cfg.cache.d2h_method, cfg.cache.eviction) == (
            "memcpy", "memcpy", "lru")
        assert not cfg.scheduler.working_set_control and cfg.scheduler.max_inject_tokens is None
    if preset == "sparseserve":
        assert (cfg.cache.h2d_method, cfg.cache.d2h_method, cfg.cache.eviction) == (
            "flash", "gpu-direct", "category-lru")
        assert cfg.scheduler.working_set_control
        assert cfg.scheduler.max_inject_tokens == 2048 * 3  # batched tokens x layers
    outs = llm.generate(prompts([17, 54]), greedy(8), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def test_explicit_flags_override_the_preset(model_dir):
    llm = LLM(model_dir, preset="sparseserve", page_size=16, device="cpu", token_budget=64, sink_pages=1,
              local_pages=1, max_num_seqs=4, max_model_len=256,
              kv_cache_memory_bytes=64 * PAGE_BYTES, kv_offloading_size=200 * PAGE_BYTES / 2**30,
              sparse_algorithm="quest", eviction="lru", working_set_control=False,
              layer_segmented_prefill=False)
    cfg = llm.engine.config
    assert cfg.sparse.algorithm == "quest" and cfg.cache.eviction == "lru"
    assert not cfg.scheduler.working_set_control and cfg.scheduler.max_inject_tokens is None
    assert cfg.cache.h2d_method == "flash"  # from the preset
    with pytest.raises(ValueError, match="unknown preset"):
        LLM(model_dir, preset="vllm")
    # the injection budget turns layer-segmented prefill on, unless it is explicitly off
    seg = LLM(model_dir, preset="sparse-offload", max_inject_tokens=100, page_size=16,
              token_budget=64, sink_pages=1, local_pages=1, max_model_len=256,
              kv_cache_memory_bytes=64 * PAGE_BYTES, kv_offloading_size=0.01)
    assert seg.engine.config.scheduler.max_inject_tokens == 100
    with pytest.raises(ValueError, match="max_inject_tokens"):
        LLM(model_dir, preset="sparse-offload", max_inject_tokens=100, page_size=16,
            layer_segmented_prefill=False,
            token_budget=64, sink_pages=1, local_pages=1, max_model_len=256,
            kv_cache_memory_bytes=64 * PAGE_BYTES, kv_offloading_size=0.01)


@pytest.mark.parametrize("control", [True, False], ids=["wc", "no-wc"])
def test_fused_retrieve_drives_the_engine_under_eviction(model_dir, control):
    """The fused retrieve kernels (Triton's interpreter here; compiled on a GPU) in the engine
    under eviction pressure (48 slots, 8 requests of 7-8 pages per head: ~60 pages of working
    sets per KV head, so decode evicts every step; layer-segmented and chunked prefill over the
    two tiers): the residency index stays exact after every step (stale entries, self-rebuilds),
    pages really are loaded and evicted, and the tokens equal the all-resident engine's."""
    lengths = [97 + 3 * i for i in range(8)]
    ps = prompts(lengths, seed=3)
    params = [greedy(16)] * len(ps)
    ref = resident(model_dir, ps, params)
    llm = offload_llm(model_dir, 48, working_set_control=control, max_num_batched_tokens=64)
    off = llm.engine.runner.offload
    off.fused = True
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(str(i), p, sp)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        off.check_invariants()
    assert [done[str(i)] for i in range(len(ps))] == ref
    stats = eng.get_stats()
    # decode really missed: selected pages had been evicted and were loaded back
    assert stats["cache_misses_total"] > 0 and stats["pages_loaded_total"] > 0, stats
    assert int((off.page_of[:, :-1] >= 0).sum()) == 0  # every slot freed with its request


@pytest.mark.parametrize("slots", [400, 24])
def test_slot_free_whole_prompt_prefill(model_dir, slots):
    """Layer-segmented prefill with GPU-direct saves: a whole prompt maps no device slot (its
    attention and summaries read the projection's K/V; the pages reach DRAM by the saver, fenced
    before the first decode step loads them). The tokens equal the all-resident sparse engine,
    prefill loads nothing, and nothing leaks. With 400 slots per layer the spare slots keep every
    prompt's pages resident (decode starts warm: nothing is loaded); with 24, fewer than one
    layer of the longest prompt (130 tokens: 9 pages x 2 KV heads = 18) next to the others'
    working sets, decode loads what it selects."""
    ps = prompts(LENGTHS)
    ref = resident(model_dir, ps, greedy())
    llm = offload_llm(model_dir, slots, d2h_method="gpu-direct", max_num_batched_tokens=64,
                      max_inject_tokens=300)
    assert llm.engine.scheduler.slot_free_prefill
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, greedy())
    done, slot_free, kept = {}, 0, 0
    real_step = eng.runner.execute

    def spy(out):
        nonlocal slot_free, kept
        slot_free += sum(c.slot_free for c in out.chunks)
        kept += sum(c.resident_pages for c in out.chunks)
        # every prompt is whole (a 1-token prompt runs all layers at once, like a decode row)
        assert all(c.slot_free for c in out.chunks if c.num_tokens > 1)
        return real_step(out)
    eng.runner.execute = spy
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        eng.check_invariants()
    assert [done[str(i)] for i in range(len(ps))] == ref
    assert slot_free >= len(ps) - 1
    stats = eng.get_stats()
    assert stats["prefill_cache_hits_total"] == 0 and stats["prefill_cache_misses_total"] == 0
    if slots == 400:
        assert kept > 0 and stats["pages_loaded_total"] == 0
    else:
        assert stats["pages_loaded_total"] > 0
    assert eng.num_free_pages() == eng.num_total_pages()
    assert int((eng.runner.offload.page_of[:, :-1] >= 0).sum()) == 0


def test_slot_free_prefill_is_charged_its_decode_need(model_dir):
    """The scheduler charges a slot-free prompt what its first decode step selects (the token
    budget's pages, unpinned), not a layer of its pages; FlashD2H (saves complete on the host)
    keeps the mapped path and its exact charge."""
    for d2h, free in (("gpu-direct", True), ("flash", False)):
        llm = offload_llm(model_dir, 400, d2h_method=d2h, max_num_batched_tokens=64,
                          max_inject_tokens=300)
        sched = llm.engine.scheduler
        assert sched.slot_free_prefill is free
        llm.engine.add_request("a", prompts([130])[0], greedy(2))
        out = sched.schedule()
        (chunk,) = out.chunks
        assert chunk.slot_free is free and chunk.start == 0 and chunk.num_tokens == 130
        # 2 KV heads; 130 tokens = 9 pages; the budget (64 tokens) = 4 pages. The slot-free
        # prompt keeps its pages resident in the spare slots (all 9: 400 slots leave plenty)
        assert chunk.resident_pages == (9 if free else 0)
        assert sched.estimated_working_set == (4 * 2 + 9 * 2 if free else 9 * 2)
        assert sched.slots.prefill_now == {"a": 18}


@pytest.mark.parametrize("slots, kept", [(400, 9), (40, 7), (10, 0)])
def test_slot_free_prompt_keeps_pages_in_spare_slots_only(model_dir, slots, kept):
    """A slot-free prompt keeps its newest pages resident only in what the step's reservations
    leave spare, at most half of it (the rest buffers the decode rows): with 40 slots per layer
    (reserve 2, decode need 4 pages x 2 heads) 30 are spare -> 7 pages per head; with 10 none."""
    llm = offload_llm(model_dir, slots, d2h_method="gpu-direct", max_num_batched_tokens=64,
                      max_inject_tokens=300)
    sched = llm.engine.scheduler
    llm.engine.add_request("a", prompts([130])[0], greedy(2))
    (chunk,) = sched.schedule().chunks
    assert chunk.slot_free and chunk.resident_pages == kept
    assert sched.estimated_working_set == 4 * 2 + kept * 2
    assert sched.slots.left >= 0
