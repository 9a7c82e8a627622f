"""Async scheduling (EngineArgs.async_scheduling): step N + 1 is scheduled and launched before
step N's tokens are read, its decode rows fed step N's tokens on the device. Everything a user
sees must equal the synchronous engine's: tokens, finish reasons and stop reasons (EOS-like
stop tokens and max_tokens ending requests while a step for them is in flight), under chunked
prefill, preemption by recompute, the two-tier cache (forced offload with eviction), aborts
mid-stream, seeded sampling, and with penalties (which run synchronously)."""
import pytest

from sparseserve import LLM, SamplingParams


LENS = (1, 17, 54, 97, 33, 5, 70, 12)


def _prompts(n=len(LENS)):
    return [{"prompt_token_ids": [3 + (j * (i + 7)) % 300 for j in range(LENS[i % len(LENS)])]}
            for i in range(n)]


def _run(path, params, prompts=None, **kw):
    kw.setdefault("max_num_seqs", 8)
    llm = LLM(path, device="cpu", dtype="float32", page_size=16, max_model_len=320, **kw)
    outs = llm.generate(prompts or _prompts(), params, use_tqdm=False)
    llm.engine.check_invariants()
    assert not llm.engine.has_unfinished_requests()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs], llm


def _same(path, params, prompts=None, ahead=True, **kw):
    sync, _ = _run(path, params, prompts, **kw)
    asy, llm = _run(path, params, prompts, async_scheduling=True, **kw)
    assert asy == sync
    # steps really ran ahead (decode inputs fed on the device), or (ahead=False) never did
    assert (llm.engine.runner.num_pending_inputs > 0) == ahead
    return sync, llm


def test_greedy_with_stops_and_lengths(tiny_model_dirs):
    """Stop tokens picked from the synchronous run's own outputs, so requests end by a stop
    token at different steps while the next step for them is already launched."""
    path, _ = tiny_model_dirs["llama-gqa"]
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    toks, _ = _run(path, base)
    stops = sorted({t[0][5] for t in toks[:3]})
    params = [SamplingParams(temperature=0.0, max_tokens=7 + 3 * i, stop_token_ids=stops)
              for i in range(len(LENS))]
    res, llm = _same(path, params)
    assert any(r[1] == "stop" for r in res) and any(r[1] == "length" for r in res)
    assert all(len(r[0]) <= 7 + 3 * i for i, r in enumerate(res))


def test_chunked_prefill_and_preemption(tiny_model_dirs):
    """A small token budget (chunked prefill, hybrid steps) and a KV cache too small for every
    request at once (preemption by recompute, also of requests with a token in flight)."""
    path, _ = tiny_model_dirs["llama-gqa"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _, llm = _same(path, params, max_num_batched_tokens=32,
                   kv_cache_memory_bytes=2 * 3 * 16 * 16 * 4 * 2 * 30)
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_two_tier_cache_with_eviction(tiny_model_dirs):
    """The sparseserve preset over a device cache smaller than the batch's pages (loads and
    evictions) and layer-segmented prefill."""
    path, _ = tiny_model_dirs["llama-gqa"]
    page_bytes = 2 * 3 * 16 * 16 * 4
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    _same(path, params, preset="sparseserve", token_budget=64, sink_pages=1, local_pages=1,
          kv_cache_memory_bytes=40 * page_bytes, kv_offloading_size=400 * page_bytes / 2**30,
          max_num_batched_tokens=48, max_num_seqs=4)


def test_seeded_sampling_and_penalties(tiny_model_dirs):
    """Seeded random sampling gives the same tokens; requests with penalties (host state per
    token) make the engine run synchronously and still match."""
    path, _ = tiny_model_dirs["llama-gqa"]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=20,
                             ignore_eos=True) for i in range(len(LENS))]
    _same(path, seeded)
    pen = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                          repetition_penalty=1.3 if i % 2 else 1.0) for i in range(len(LENS))]
    _same(path, pen, ahead=False)


def test_abort_while_a_step_is_in_flight(tiny_model_dirs):
    """Aborting a request whose next step is launched: it ends, the others go on as in the
    synchronous engine, nothing leaks."""
    path, _ = tiny_model_dirs["llama-gqa"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    results = {}
    for mode in (False, True):
        llm = LLM(path, device="cpu", dtype="float32", page_size=16, max_model_len=320,
                  max_num_seqs=8, async_scheduling=mode)
        eng = llm.engine
        for i, p in enumerate(_prompts(4)):
            eng.add_request(str(i), p, params)
        done = {}
        steps = 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                done[o.request_id] = list(o.outputs[0].token_ids)
            steps += 1
            if steps == 6:
                eng.abort_request("1")
        eng.check_invariants()
        assert eng.scheduler.kv.num_free_pages == eng.scheduler.kv.num_pages
        results[mode] = {k: v for k, v in done.items() if k != "1"}
    assert results[True] == results[False]


def test_async_scheduling_needs_one_gpu(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(path, device="cpu", async_scheduling=True, tensor_parallel_size=2)


def test_logprobs_run_ahead(tiny_model_dirs):
    """Requests asking for logprobs run ahead too (the logprobs travel with the tokens'
    pinned copy) and get the synchronous engine's values."""
    path, _ = tiny_model_dirs["llama-gqa"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    got = {}
    for mode in (False, True):
        llm = LLM(path, device="cpu", dtype="float32", page_size=16, max_model_len=320,
                  max_num_seqs=8, async_scheduling=mode)
        outs = llm.generate(_prompts(4), params, use_tqdm=False)
        got[mode] = [[{t: round(lp.logprob, 5) for t, lp in d.items()}
                      for d in o.outputs[0].logprobs] for o in outs]
        if mode:
            assert llm.engine.runner.num_pending_inputs > 0
    assert got[True] == got[False] and all(len(x) == 12 for x in got[True])


def test_embedded_model_stop_strings_and_n(smollm2_llm):
    """The embedded SmolLM2 with a tokenizer: stop strings (found by the detokenizer a step
    after the token was launched past) and n > 1 give the synchronous engine's texts."""
    prompts = ["The capital of France is", "List three colors:", "Once upon a time"]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[".", "\n"]),
              SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=20)]
    sync = smollm2_llm.generate(prompts, params, use_tqdm=False)
    llm = LLM(max_num_seqs=8, async_scheduling=True)
    asy = llm.generate(prompts, params, use_tqdm=False)
    key = lambda outs: [[(c.text, c.finish_reason, c.stop_reason) for c in o.outputs]  # noqa: E731
                        for o in outs]
    assert key(asy) == key(sync)
    assert llm.engine.runner.num_pending_inputs > 0
