"""The prefill part of benchmarks/offload.py: one long prompt prefilled to its first token
with each way of saving the KV to the host tier (FlashD2H, per-page copies, GPU-direct) and
without saving, in chunked and in layer-segmented mode; the time to the first token, the
time until the last save landed, and the ratio to the same mode without saving."""
from __future__ import annotations

import time

import common as C
import numpy as np
from engine_bench import log, prompt_ids
from offload_bench import Bench
from offload_engine import Engine, cache_stats, stats_delta
from offload_shape import GiB, host_pinned_stats

PREFILL_METHODS = ("nosave", "flash", "memcpy", "gpu-direct")
TARGET_PREFILL_RATIO = 1.05  # issue 4: FlashD2H prefill <= 1.05x the prefill without saving


def _tokens_done(engine, rid: str, prompt_len: int, num_layers: int) -> int:
    req = engine.scheduler.requests.get(rid)
    if req is None:
        return prompt_len
    done = req.num_computed_tokens
    seg = getattr(engine.scheduler, "_segment_tokens", {}).get(rid, 0)
    return int(done + seg * getattr(req, "prefill_layer", 0) / num_layers)


def timed_prefill(eng: Engine, ids: list[int], rid: str, stop_at: float) -> dict:
    """Prefill one prompt to its first token; the runner's steps timed one by one."""
    from sparseserve import SamplingParams

    engine = eng.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    s0 = cache_stats(engine)
    step_s, host_s, cut = [], [], False
    done = len(ids)
    C.synchronize()
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        if time.perf_counter() > stop_at:
            done = _tokens_done(engine, rid, len(ids), eng.bench.shape.layers)
            engine.abort_request(rid)
            cut = True
            break
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)
        host_s.append(engine.last_step_host_time_s)
    C.synchronize()
    first = time.perf_counter() - t0
    if eng.offload is not None:
        eng.offload.saver.wait_all()
    drained = time.perf_counter() - t0
    d = stats_delta(s0, cache_stats(engine), eng.bench.shape.layer_page_bytes)
    rec = {"prompt_len": len(ids), "time_s": first, "drained_s": drained,
           "steps": len(step_s), "step_s": step_s, "host_s_total": float(sum(host_s)),
           "bytes_saved": d["bytes_saved_total"], "bytes_loaded": d["bytes_loaded_total"],
           "cut_by_time_budget": cut, "tokens_done": done}
    if cut:
        rec["extrapolated_time_s"] = first * len(ids) / max(done, 1)
    return rec


def prefill_run(b: Bench, mode: str, method: str) -> None:
    a, sh = b.args, b.shape
    part = f"prefill/{mode}/{method}"
    res = b.result["prefill"]["runs"]
    P = a.prefill_len
    segmented = mode == "segmented"
    batched = P if segmented else a.prefill_chunk
    reps = a.memcpy_reps if method == "memcpy" else a.prefill_reps
    one = P * b.sec_per_token * (4.0 if method == "memcpy" else 1.3)
    if method == "memcpy":
        one = min(one, a.memcpy_budget_s)
    est = b.load_s + one * (reps + 0.6)
    if not b.fits(part, est):
        return
    max_len = P + 1
    kw = {**b.base_kwargs(), **b.sparse_kwargs(), "max_model_len": max_len, "max_num_seqs": 1,
          "max_num_batched_tokens": batched, "enforce_eager": True}
    if segmented:
        kw["max_inject_tokens"] = P * a.segment_layers  # segment_layers layers per step
    ids_needed = sh.ids(1, max_len)
    pinned = None
    if method == "nosave":
        kw["kv_cache_memory_bytes"] = (ids_needed + 4 * sh.kv_heads) * sh.page_bytes
    else:
        ids_needed = sh.host_ids(1, max_len)
        pinned = b.prepare_pinned(part, ids_needed)
        if pinned is None:
            return
        mandatory = sh.kv_heads * (a.token_budget // a.page_size)
        kw.update(kv_offload=True, kv_offloading_size=(ids_needed + 0.5) * sh.page_bytes / GiB,
                  # a prefill keeps its prompt's pages in slots
                  kv_cache_memory_bytes=max(2 * mandatory, sh.ids(1, max_len) + 4 * sh.kv_heads)
                  * sh.page_bytes, d2h_method=method,
                  h2d_method=a.h2d_method, eviction=a.eviction)
    log(b.deadline, f"{part}: {P}-token prompt, max_num_batched_tokens={batched}"
                    + (f", prefill_layers_per_step={a.segment_layers}" if segmented else ""))
    rec: dict = {"mode": mode, "method": method, "max_num_batched_tokens": batched,
                 "layers_per_step": a.segment_layers if segmented else None,
                 "host_tier": pinned, "reps": []}
    res[f"{mode}/{method}"] = rec
    rng = np.random.default_rng(a.seed)
    try:
        with Engine(b, kw) as eng, C.peak_memory(rec):
            rec["engine"] = eng.info
            # warm-up (Triton compiles, cuBLAS/SDPA heuristics): two chunks, the second with
            # history, in chunked mode; one shorter prompt in segmented mode; the slow
            # per-page copies get one short chunk (the kernels compiled in earlier runs)
            warm_len = min(P, batched + batched // 16 if not segmented else max(64, P // 8))
            left = b.deadline.remaining() - a.reserve_s
            if method == "memcpy":
                warm_len, left = min(warm_len, max(64, P // 32)), min(left, a.memcpy_budget_s)
            w = timed_prefill(eng, prompt_ids(rng, warm_len, b.vocab), "warmup",
                              time.perf_counter() + max(left, 1))
            rec["warmup"] = {k: w[k] for k in ("prompt_len", "time_s", "drained_s", "steps",
                                               "cut_by_time_budget")}
            log(b.deadline, f"  warm-up {warm_len} tokens: {w['time_s']:.2f} s")
            ids = prompt_ids(rng, P, b.vocab)
            for i in range(reps):
                left = b.deadline.remaining() - a.reserve_s
                if i and left < 2 * rec["reps"][-1]["drained_s"] + 5:
                    b.skip(f"{part}/rep{i}", "time budget")
                    break
                budget = min(left, a.memcpy_budget_s) if method == "memcpy" else left
                r = timed_prefill(eng, ids, f"prefill-{i}", time.perf_counter() + max(budget, 1))
                rec["reps"].append(r)
                log(b.deadline, f"  rep {i}: {r['time_s']:.3f} s to first token, "
                                f"{r['drained_s']:.3f} s drained, {r['steps']} steps, "
                                f"saved {r['bytes_saved'] / GiB:.2f} GiB"
                    + (f" (CUT after {r['tokens_done']} tokens: ~{r['extrapolated_time_s']:.1f}"
                       " s extrapolated)" if r["cut_by_time_budget"] else ""))
                b.save()
                if r["cut_by_time_budget"]:
                    break
    except Exception as exc:  # noqa: BLE001 - record, go on with the other runs
        rec.update(b.fail(part, exc))
    C.free_device_memory()  # here, not in the except block: its traceback holds the engine
    rec["host_pinned"] = host_pinned_stats()
    _summarize_prefill(b, rec)
    b.save()


def _summarize_prefill(b: Bench, rec: dict) -> None:
    reps = [r for r in rec.get("reps", []) if not r["cut_by_time_budget"]]
    cut = [r for r in rec.get("reps", []) if r["cut_by_time_budget"]]
    rec["cut_by_time_budget"] = bool(cut)
    if reps:
        rec["time_s"] = C.summarize(r["time_s"] for r in reps)
        rec["drained_s"] = C.summarize(r["drained_s"] for r in reps)
        rec["median_s"] = rec["time_s"]["median"]
        rec["median_drained_s"] = rec["drained_s"]["median"]
        rec["prefill_tokens_per_s"] = reps[0]["prompt_len"] / rec["median_s"]
        if rec["method"] == "nosave" and rec["mode"] == "chunked":
            b.sec_per_token = rec["median_s"] / reps[0]["prompt_len"]
    elif cut:
        rec["median_s"] = rec["median_drained_s"] = None
        rec["extrapolated_time_s"] = cut[0]["extrapolated_time_s"]


def prefill_ratios(result: dict) -> dict:
    runs = result["prefill"]["runs"]
    out = {}
    for key, r in runs.items():
        mode, method = key.split("/")
        base = runs.get(f"{mode}/nosave", {})
        t = r.get("median_s") or r.get("extrapolated_time_s")
        td = r.get("median_drained_s") or r.get("extrapolated_time_s")
        if method == "nosave" or not t or not base.get("median_s"):
            continue
        ratio = t / base["median_s"]
        out[key] = {"ratio": ratio, "ratio_drained": td / base["median_s"],
                    "extrapolated": r.get("median_s") is None,
                    "meets_target": ratio <= TARGET_PREFILL_RATIO if method == "flash" else None}
        r["ratio_to_nosave"] = ratio
        r["ratio_drained_to_nosave"] = td / base["median_s"]
    return out
