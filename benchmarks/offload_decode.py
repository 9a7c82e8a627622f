"""The decode part of benchmarks/offload.py: per batch x context, the sizes of the runs (the
plan), then decode with the two-tier cache at several device-cache sizes next to the
all-resident sparse and the dense engines; ms per step, host time, pages loaded per step and
the hit rate over the timed pure-decode steps, and the ratios to the two baselines."""
from __future__ import annotations

import math
import time

import common as C
import numpy as np
from engine_bench import ExecuteTimer, log, prompt_ids, pure_decode
from offload_bench import Bench
from offload_engine import Engine, cache_stats, hit_rate, stats_delta
from offload_shape import GiB, host_pinned_stats


def decode_plan(b: Bench, batch: int, context: int) -> dict:
    """Sizes for one batch x context: the prompt length (room for the tokens early requests
    decode while the others prefill, plus warm-up and timed steps), full and mandatory slots."""
    a, sh = b.args, b.shape
    max_len = context
    M = a.decode_chunk
    prefill_steps = -(-batch * max_len // max(1, M - batch)) + 2
    room = prefill_steps + a.decode_warmup + a.decode_steps + 4
    prompt = max_len - room
    if prompt < a.token_budget:
        raise ValueError(f"decode {batch}x{context}: prompt of {prompt} tokens is shorter than "
                         "the token budget; use a longer context")
    full = sh.ids(batch, max_len)  # slots per layer for every page of every request
    mandatory = batch * sh.kv_heads * (a.token_budget // a.page_size)
    return {"batch": batch, "context_nominal": context, "max_model_len": max_len,
            "prompt_len": prompt,
            "decode_room_tokens": room, "max_num_batched_tokens": M,
            "full_slots_per_layer": full, "mandatory_slots_per_layer": mandatory,
            "mandatory_fraction": mandatory / full,
            "full_kv_gib": full * sh.page_bytes / GiB,
            "host_pinned_gib": sh.pinned_bytes(sh.host_ids(batch, max_len)) / GiB}




def make_plans(b: Bench, configs: list[tuple[int, int]]) -> list[dict]:
    """A plan per BATCHxCONTEXT (a config too short for the token budget is an error), each
    with its slot in result["decode"]["configs"], and the notes on their sizes."""
    result, sh = b.result, b.shape
    plans = []
    for batch, ctx in configs:
        try:
            plan = decode_plan(b, batch, ctx)
        except ValueError as exc:
            b.fail(f"decode/b{batch}x{ctx}", exc)
            continue
        plan["key"] = f"b{batch}_ctx{plan['max_model_len']}"
        result["decode"]["configs"][plan["key"]] = {"plan": plan, "runs": {}}
        plans.append(plan)
        kv = ctx * batch * sh.kv_bytes_per_token
        result["notes"].append(
            f"batch {batch} x {plan['max_model_len']}: {kv / GiB:.1f} GiB of KV "
            f"({sh.kv_bytes_per_token // 1024} KiB per token), all of it pinned in the "
            "host tier of the offload runs and resident in HBM in the baselines")
        if batch >= 32 and ctx < 32768 and not b.args.smoke:
            result["notes"].append(
                f"batch {batch} runs at {ctx} tokens, not 32k: {batch} x 32768 tokens "
                f"would be {batch * 32768 * sh.kv_bytes_per_token / GiB:.0f} GiB of "
                "KV, more than the host's RAM (--decode-configs sets the sizes)")
    result["notes"].append(
        "decode cache fractions: slots per layer = max(mandatory, ceil(fraction x "
        "full)); full = batch x kv_heads x pages of max_model_len; 'min' = mandatory. "
        "Prefill writes only to DRAM, so the device tier fills during decode: requests "
        "that finish prefill early already decode in the later (hybrid) prefill steps; "
        "the first pure-decode step (it loads at least the last request's whole "
        "selection) is reported as first_step_ms and is not timed.")
    return plans

def measure_decode(b: Bench, eng: Engine, plan: dict, stop_at: float) -> dict:
    """Prefill the batch, warm up, time pure decode steps with per-step cache counters."""
    from sparseserve import SamplingParams

    a, sh = b.args, b.shape
    engine = eng.engine
    batch, P = plan["batch"], plan["prompt_len"]
    rng = np.random.default_rng(a.seed + batch)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    rids = [f"dec-{batch}-{i}" for i in range(batch)]
    sched, runner = engine.scheduler, engine.runner  # runner: None with TP > 1
    rec: dict = {}
    execute = ExecuteTimer(engine.executor)  # the model's wall time of each timed step
    exec_s = execute.times
    graphs = getattr(runner, "graphs", None)  # graph replays are counted in-process only
    replays = [0]
    graph_run = getattr(graphs, "run", None)

    def counted_run(*args, **kwargs):  # did the timed steps replay a CUDA graph?
        replays[0] += 1
        return graph_run(*args, **kwargs)

    try:
        C.synchronize()
        t0 = time.perf_counter()
        for rid in rids:
            engine.add_request(rid, {"prompt_token_ids": prompt_ids(rng, P, b.vocab)}, params)
        steps, seen = 0, set()
        while not (len(seen) == batch and pure_decode(sched, batch) is not False):
            if time.perf_counter() > stop_at:
                raise TimeoutError(f"prefill of {batch} x {P} tokens cut by the time budget "
                                   f"after {steps} steps")
            outs = engine.step()
            steps += 1
            if any(o.finished for o in outs):
                raise RuntimeError("a request finished before the batch reached decode; "
                                   "the decode room is too small")
            seen.update(o.request_id for o in outs)
            if steps > 4 * batch * P + 16:
                raise RuntimeError("requests did not all reach decode")
        C.synchronize()
        rec["prefill"] = {"wall_s": time.perf_counter() - t0, "steps": steps,
                          "tokens": batch * P}
        rec["prefill"]["tokens_per_s"] = batch * P / rec["prefill"]["wall_s"]
        s = cache_stats(engine)
        warm = []
        for i in range(a.decode_warmup):
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            s2 = cache_stats(engine)
            d = stats_delta(s, s2, sh.layer_page_bytes)
            warm.append({"ms": dt * 1e3, "host_ms": engine.last_step_host_time_s * 1e3,
                         "pages_loaded": d["pages_loaded"], "hits": d["cache_hits_total"],
                         "misses": d["cache_misses_total"]})
            s = s2
        rec["warmup_steps"] = warm
        if warm:  # the first decode step after prefill: the device tier starts empty
            rec["first_step_ms"] = warm[0]["ms"]
            rec["first_step_pages_loaded"] = warm[0]["pages_loaded"]
        ctx0 = [r.num_tokens for r in sched.running]
        rec["context_tokens_at_timing_start"] = {"min": min(ctx0), "max": max(ctx0)}
        per, pure, host = [], [], []
        s_start = s
        execute.install()
        if graph_run is not None:
            graphs.run = counted_run
        for i in range(a.decode_steps):
            if time.perf_counter() > stop_at:
                rec["timed_steps_cut_by_time_budget"] = True
                break
            pure.append(pure_decode(sched, batch))
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            s2 = cache_stats(engine)  # syncs, outside the timed region
            d = stats_delta(s, s2, sh.layer_page_bytes)
            host.append(engine.last_step_host_time_s)
            per.append({"ms": dt * 1e3, "host_ms": host[-1] * 1e3,
                        "pages_loaded": d["pages_loaded"], "hits": d["cache_hits_total"],
                        "misses": d["cache_misses_total"], "bytes_saved": d["bytes_saved_total"]})
            s = s2
    finally:
        execute.remove()
        if graph_run is not None:
            graphs.__dict__.pop("run", None)
        try:
            engine.abort_request(rids)
        except Exception:  # noqa: BLE001
            pass
    n = len(per)
    step_s = [p["ms"] / 1e3 for p in per]
    tot = stats_delta(s_start, s, sh.layer_page_bytes) if n else None
    rec.update({
        "timed_steps": n, "pure_decode_steps": sum(1 for p in pure if p),
        "pure_decode_verified": None not in pure,
        "cuda_graph_replays": replays[0] if runner is not None else None,
        "cuda_graphs_used": bool(n and replays[0] == n) if runner is not None else None,
        "step_ms": C.summarize(step_s, 1e3), "host_ms": C.summarize(host, 1e3),
        "execute_ms": C.summarize(exec_s, 1e3),
        "engine_overhead_ms": C.summarize([s_ - e for s_, e in zip(step_s, exec_s)], 1e3)
        if len(exec_s) == n else C.summarize([]),
        "per_step": per,
    })
    if n:
        med = rec["step_ms"]["median"]
        rec["ms_per_step"] = med
        rec["host_frac"] = rec["host_ms"]["median"] / med if med else None
        rec["output_tokens_per_s"] = batch / (med / 1e3) if med else None
        rec["pages_loaded_per_step"] = tot["pages_loaded"] / n
        rec["pages_loaded_per_step_per_layer"] = tot["pages_loaded"] / n / sh.layers
        rec["bytes_loaded_per_step"] = tot["bytes_loaded_total"] / n
        rec["load_gb_per_s_of_step"] = (tot["bytes_loaded_total"] / n) / (med / 1e3) / 1e9 \
            if med else None
        rec["hits_per_step"] = tot["cache_hits_total"] / n
        rec["misses_per_step"] = tot["cache_misses_total"] / n
        rec["hit_rate"] = hit_rate(tot)
        rec["bytes_saved_per_step"] = tot["bytes_saved_total"] / n
    return rec


def decode_run(b: Bench, plan: dict, kind: str, fraction=None) -> None:
    import torch

    a, sh = b.args, b.shape
    batch, key = plan["batch"], plan["key"]
    label = kind if kind != "offload" else f"offload-{fraction}"
    part = f"decode/{key}/{label}"
    runs = b.result["decode"]["configs"][key]["runs"]
    prefill_est = plan.get("measured_prefill_s") or \
        plan["batch"] * plan["prompt_len"] * b.sec_per_token * 1.3
    est = b.load_s + 1.2 * prefill_est + (a.decode_warmup + a.decode_steps) * \
        b.step_estimate_s + 3
    kw = {**b.base_kwargs(), "max_model_len": plan["max_model_len"], "max_num_seqs": batch,
          "max_num_batched_tokens": plan["max_num_batched_tokens"],
          "enforce_eager": a.enforce_eager}
    rec: dict = {"kind": kind, "cache_fraction_requested": fraction}
    full, mand = plan["full_slots_per_layer"], plan["mandatory_slots_per_layer"]
    if kind == "dense":
        kw.update(sparse_algorithm="dense", kv_cache_memory_bytes=(full + 4 * sh.kv_heads)
                  * sh.page_bytes)
    elif kind == "resident-sparse":
        kw.update(**b.sparse_kwargs(), kv_cache_memory_bytes=(full + 4 * sh.kv_heads)
                  * sh.page_bytes)
    else:
        # never below what the batch selects plus one prompt (a prefill keeps its pages in slots)
        floor = mand + sh.ids(1, plan["max_model_len"])  # decoders + one prefill
        slots = floor if fraction == "min" else max(floor, int(math.ceil(fraction * full)))
        rec["floored_to_mandatory"] = fraction != "min" and fraction * full < floor
        # a fixed decode batch: no working-set control (it would make requests wait)
        kw["working_set_control"] = False
        rec["capped_by_memory"] = False
        if b.device == "cuda":
            free = torch.cuda.mem_get_info()[0]
            summaries = 2 * (full + 1) * sh.head_dim * sh.dtype_bytes * sh.layers
            room = free - sh.weight_bytes - summaries - a.gpu_reserve_gib * GiB
            if slots * sh.page_bytes > room:
                slots = max(mand, int(room // sh.page_bytes))
                rec["capped_by_memory"] = True
        same = [k for k, r in runs.items() if r.get("slots_per_layer") == slots
                and r.get("kind") == "offload" and r.get("ms_per_step") is not None]
        if same:
            runs[label] = {**rec, "same_as": same[0], "slots_per_layer": slots,
                           "cache_fraction": slots / full}
            b.skip(part, f"same device cache as {same[0]} ({slots} slots per layer)")
            return
        rec["slots_per_layer"] = slots
        rec["cache_fraction"] = slots / full
        rec["device_cache_gib"] = slots * sh.page_bytes / GiB
        kw.update(**b.sparse_kwargs(), kv_offload=True,
                  kv_offloading_size=(sh.host_ids(batch, plan["max_model_len"]) + 0.5)
                  * sh.page_bytes / GiB,
                  kv_cache_memory_bytes=slots * sh.page_bytes, h2d_method=a.h2d_method,
                  d2h_method=a.d2h_method, eviction=a.eviction)
    runs[label] = rec
    if not b.fits(part, est):
        rec["skipped"] = True
        return
    if kind == "offload":
        pinned = b.prepare_pinned(part, sh.host_ids(batch, plan["max_model_len"]))
        if pinned is None:
            rec["skipped"] = True
            return
        rec["host_tier"] = pinned
    log(b.deadline, f"{part}: {batch} x {plan['prompt_len']}-token prompts"
                    + (f", {rec['slots_per_layer']} slots/layer ({100 * rec['cache_fraction']:.1f}%"
                       " of the full KV)" if kind == "offload" else ""))
    attempts = [kw]
    if kind == "offload" and not a.enforce_eager and not a.no_eager_retry:
        attempts.append({**kw, "enforce_eager": True})
    for i, kwi in enumerate(attempts):
        if i:
            if b.deadline.remaining() - a.reserve_s < est:
                break
            log(b.deadline, "  retrying with enforce_eager=True")
            rec["first_attempt"] = {k: rec.pop(k) for k in ("error", "traceback") if k in rec}
            rec["retried_eager"] = True
        try:
            with Engine(b, kwi) as eng, C.peak_memory(rec):
                rec["engine"] = eng.info
                stop_at = time.perf_counter() + b.deadline.remaining() - a.reserve_s
                rec.update(measure_decode(b, eng, plan, stop_at))
            if rec.get("prefill"):
                plan["measured_prefill_s"] = max(plan.get("measured_prefill_s") or 0,
                                                 rec["prefill"]["wall_s"])
            if rec.get("ms_per_step"):
                b.step_estimate_s = max(b.step_estimate_s if b.measured_steps else 0,
                                        2 * rec["step_ms"]["max"] / 1e3)
                b.measured_steps = True
                log(b.deadline, f"  prefill {rec['prefill']['wall_s']:.1f} s; decode "
                                f"{rec['ms_per_step']:.2f} ms/step (median of "
                                f"{rec['timed_steps']}), host {rec['host_ms']['median']:.2f} ms"
                    + (f", {rec['pages_loaded_per_step']:.0f} pages loaded/step, hit rate "
                       f"{100 * (rec['hit_rate'] or 0):.1f}%" if kind == "offload" else "")
                    + f", graphs {'on' if rec['cuda_graphs_used'] else 'off'}")
            break
        except Exception as exc:  # noqa: BLE001
            rec.update(b.fail(part, exc))
            if isinstance(exc, TimeoutError):
                break
        C.free_device_memory()  # outside the except block: its traceback holds the engine
    C.free_device_memory()
    rec["host_pinned"] = host_pinned_stats()
    b.save()


def decode_ratios(result: dict) -> None:
    for key, c in result["decode"]["configs"].items():
        runs = c["runs"]
        res = runs.get("resident-sparse", {}).get("ms_per_step")
        dense = runs.get("dense", {}).get("ms_per_step")
        for label, r in runs.items():
            ms = r.get("ms_per_step")
            if ms is None:
                continue
            r["ratio_to_resident_sparse"] = ms / res if res else None
            r["ratio_to_dense"] = ms / dense if dense else None
