"""The sparseserve side of benchmarks/offline_throughput.py: build the dense engine for a
part, warm it up, run a workload offline (every request added, stepped until all finish),
and the part that does that and/or the decode-step bench on one engine."""
from __future__ import annotations

import time

import common as C
import numpy as np
from engine_bench import engine_graph_sizes, fail, log, prompt_ids
from offline_decode_steps import bench_decode
from offline_workloads import Workload, engine_plan, make_prompts


def make_llm(model: str, setup: dict, max_len: int, num_seqs: int, batched: int, kv_bytes: int,
             enforce_eager: bool, seed: int):
    import dataclasses

    from sparseserve import LLM
    from sparseserve.engine.args import EngineArgs

    kw = dict(load_format="dummy", dtype=setup["dtype"], device=setup["device"],
              max_model_len=max_len, max_num_seqs=num_seqs, max_num_batched_tokens=batched,
              kv_cache_memory_bytes=kv_bytes, enforce_eager=enforce_eager, seed=seed)
    if "sparse_algorithm" in {f.name for f in dataclasses.fields(EngineArgs)}:
        kw["sparse_algorithm"] = "dense"  # this benchmark measures the dense engine
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    C.synchronize()
    eng = llm.engine
    info = {"engine_args": kw, "load_s": time.perf_counter() - t0,
            "num_pages": eng.config.cache.num_pages,
            "max_model_len": eng.config.scheduler.max_model_len,
            # decode CUDA graphs the runner captured (None: it runs eagerly)
            "cuda_graph_batch_sizes": engine_graph_sizes(eng)}
    return llm, info


def warmup(llm, w: Workload, vocab: int) -> None:
    """A short version of the workload before timing: as many requests, prompts long enough
    to need chunking, and staggered lengths (34 + i tokens, past a page boundary), so decode
    runs at every batch size from n down to 1. Triton compilation, CUDA graphs captured on
    first use, cuBLAS/SDPA heuristics and the allocator all settle here, not in the timed run."""
    from sparseserve import SamplingParams

    rng = np.random.default_rng(1)
    n = w.num_requests
    length = min(w.prompt_len, max(16, w.max_num_batched_tokens * 5 // 4 // n))
    prompts = [{"prompt_token_ids": prompt_ids(rng, length, vocab)} for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=34 + i, ignore_eos=True)
              for i in range(n)]
    llm.generate(prompts, params, use_tqdm=False)


def run_offline(engine, prompts: np.ndarray, output_len: int, stop_at: float,
                device: str) -> dict:
    """Add every request, then step until all finish (what LLM.generate does, plus per-step
    records and a deadline). Tokens/s count prompt + output tokens over the wall time."""
    from sparseserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    n, p = prompts.shape
    ids = [f"bench-{i}" for i in range(n)]
    started, produced = set(), {}
    steps, host_s, all_started_s, truncated = 0, 0.0, None, False
    preempt0 = engine.get_stats().get("num_preemptions_total", 0)
    C.synchronize(device)
    t0 = time.perf_counter()
    for rid, row in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": row.tolist()}, params)
    while engine.has_unfinished_requests():
        if time.perf_counter() > stop_at:
            engine.abort_request(ids)
            truncated = True
            break
        for out in engine.step():
            started.add(out.request_id)
            produced[out.request_id] = len(out.outputs[0].token_ids)
        steps += 1
        host_s += engine.last_step_host_time_s
        if all_started_s is None and len(started) == n:
            all_started_s = time.perf_counter() - t0
    C.synchronize(device)
    wall = time.perf_counter() - t0
    out_tokens = sum(produced.values())
    return {
        "wall_s": wall, "num_steps": steps,
        "prompt_tokens": n * p, "output_tokens": out_tokens,
        "total_tokens_per_s": (n * p + out_tokens) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": n / wall,
        "time_to_all_first_tokens_s": all_started_s,  # ~ the prefill phase
        "host_time_s_total": host_s, "host_frac_of_wall": host_s / wall,
        "all_full_length": (not truncated and len(produced) == n
                            and all(v == output_len for v in produced.values())),
        "truncated_by_time_budget": truncated,
        "num_preemptions": engine.get_stats().get("num_preemptions_total", 0) - preempt0,
    }


def sparseserve_part(name: str, model: str, setup: dict, args, ws: dict,
                     deadline: C.Deadline, result: dict, save, batched: int | None = None) -> None:
    """One engine: throughput of workload `name` ("a"/"b") and/or the decode-step bench
    ("steps" on workload a's engine; "steps-eager" the same with enforce_eager=True)."""
    cfg, eager = setup["cfg"], name == "steps-eager"
    plan = engine_plan(name, ws, setup, batched)
    w = plan["workload"]
    res = result["results"]
    steps_key = "eager" if eager else "default"
    log(deadline, f"sparseserve {name}: loading engine (max_model_len={plan['max_len']}, "
                  f"max_num_seqs={plan['seqs']}, max_num_batched_tokens={plan['batched']}, "
                  f"kv={plan['kv_bytes'] / 2**30:.1f} GiB)")
    llm, retry = None, False
    try:
        try:
            llm, info = make_llm(model, setup, plan["max_len"], plan["seqs"], plan["batched"],
                                 plan["kv_bytes"], eager, args.seed)
            log(deadline, f"  loaded in {info['load_s']:.1f}s; warming up")
            warmup(llm, w, cfg["vocab_size"])
        except Exception as exc:  # noqa: BLE001 - record, go on with the other parts
            fail(deadline, result, f"sparseserve-{name}-load", exc)
            if plan["throughput"]:
                res[name]["sparseserve"] = C.error_record(exc)
            if plan["steps"]:
                res["decode_steps"][steps_key] = C.error_record(exc)
            return
        if plan["throughput"]:
            rec = {"engine": info}
            try:
                stop_at = time.perf_counter() + max(deadline.remaining() - 20, 5)
                prompts = make_prompts(np.random.default_rng(args.seed), w.num_requests,
                                       w.prompt_len, cfg["vocab_size"])
                with C.peak_memory(rec):
                    rec.update(run_offline(llm.engine, prompts, w.output_len, stop_at,
                                           setup["device"]))
                log(deadline, f"  {name}: {rec['wall_s']:.2f}s, "
                              f"{rec['total_tokens_per_s']:,.0f} tok/s total, "
                              f"{rec['output_tokens_per_s']:,.0f} out tok/s")
            except Exception as exc:  # noqa: BLE001
                fail(deadline, result, f"sparseserve-{name}", exc)
                rec.update(C.error_record(exc))
                # out of memory in a chunked prefill: retry once, a whole prompt per step
                retry = C.is_oom(exc) and plan["batched"] < w.prompt_len and batched is None
                try:
                    llm.engine.abort_request([f"bench-{i}" for i in range(w.num_requests)])
                except Exception:  # noqa: BLE001
                    pass
            if batched is not None and "sparseserve" in res[name]:  # this is the retry
                res[name]["sparseserve_first_attempt"] = res[name]["sparseserve"]
            res[name]["sparseserve"] = rec
            save()
        if plan["steps"]:
            rec = {"engine": info, "batches": {}}
            res["decode_steps"][steps_key] = rec
            d = setup["decode"]
            for b in d["batches"]:
                try:
                    stop_at = time.perf_counter() + max(deadline.remaining() - 20, 5)
                    r = bench_decode(llm.engine, b, d["context"], d["warmup"], d["steps"],
                                     cfg["vocab_size"], args.seed, stop_at)
                    log(deadline, f"  decode[{steps_key}] batch {b}: "
                                  f"{r['step_ms']['mean']:.2f} ms/step, "
                                  f"host {100 * (r['host_frac'] or 0):.1f}%")
                except Exception as exc:  # noqa: BLE001
                    fail(deadline, result, f"sparseserve-{name}-batch{b}", exc)
                    r = C.error_record(exc)
                rec["batches"][str(b)] = r
                save()
    finally:
        del llm
        mem = C.free_device_memory()
        if mem:
            result.setdefault("memory_after_free", {})[name] = mem
    if retry and not deadline.expired(60):
        log(deadline, f"  retrying {name} with max_num_batched_tokens={w.prompt_len}")
        sparseserve_part(name, model, setup, args, ws, deadline, result, save, w.prompt_len)
