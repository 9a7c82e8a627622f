"""The decode-step bench of benchmarks/offline_throughput.py: prefill a batch, then time
steps in which every request decodes; step wall time, the runner's host time, the runner's
execute time and the engine's own overhead around it."""
from __future__ import annotations

import time

import common as C
import numpy as np
from engine_bench import ExecuteTimer, prompt_ids, pure_decode
from offline_workloads import TARGET_HOST_FRAC


def bench_decode(engine, batch: int, ctx: int, warm: int, steps: int, vocab: int,
                 seed: int, stop_at: float) -> dict:
    """Prefill `batch` requests of `ctx` tokens, then time `steps` pure decode steps."""
    from sparseserve import SamplingParams

    rng = np.random.default_rng(seed + batch)
    params = SamplingParams(temperature=0.0, max_tokens=warm + steps + 8, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": prompt_ids(rng, ctx, vocab)}, params)
    sched = engine.scheduler
    execute = ExecuteTimer(engine.executor)  # the model's wall time of each timed step
    exec_times = execute.times
    step_s, host_s, pure = [], [], []
    try:
        seen: set[str] = set()  # requests that produced their first token
        for _ in range(4 * ctx + 16):  # prefill (chunked) until every request decodes
            if len(seen) == batch and pure_decode(sched, batch) is not False:
                break
            seen.update(o.request_id for o in engine.step())
        else:
            raise RuntimeError(f"batch {batch}: requests did not all reach decode")
        for _ in range(warm):
            engine.step()
        execute.install()
        for _ in range(steps):
            if time.perf_counter() > stop_at:
                break
            pure.append(pure_decode(sched, batch))
            t = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t)
            host_s.append(engine.last_step_host_time_s)
    finally:
        execute.remove()
        engine.abort_request(ids)
    overhead = [s - e for s, e in zip(step_s, exec_times)] if len(exec_times) == len(step_s) \
        else []
    mean_step = float(np.mean(step_s)) if step_s else float("nan")
    res = {
        "batch": batch, "context_len_start": ctx + warm, "timed_steps": len(step_s),
        "pure_decode_steps": sum(1 for p in pure if p), "pure_decode_verified": None not in pure,
        "step_ms": C.summarize(step_s, 1e3), "host_ms": C.summarize(host_s, 1e3),
        "execute_ms": C.summarize(exec_times, 1e3),
        "engine_overhead_ms": C.summarize(overhead, 1e3),
        "host_frac": float(np.mean(host_s)) / mean_step if step_s else None,
        "host_total_frac": (float(np.mean(host_s)) + float(np.mean(overhead))) / mean_step
        if overhead else None,
        "output_tokens_per_s": batch / mean_step if step_s else None,
    }
    res["meets_host_target"] = res["host_frac"] is not None and res["host_frac"] < TARGET_HOST_FRAC
    return res
