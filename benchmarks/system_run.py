"""One end-to-end run of benchmarks/system.py: a trace through LLMEngine.add_request/step, as a
user of the offline API drives it, with per-step records taken from the scheduler's output.

Every request arrives at t=0 (the offline trace of the end-to-end issue) unless its trace entry
has an "arrival_s" (then it is added once the clock passes it; TTFT counts from it). Per step: wall time
(the device synchronised after each step, so a step's time is its own), decode rows, prefill
work (prompt tokens x layers run / layers), pages loaded from DRAM, requests waiting for
device slots, the admitted working-set estimate. Per request: TTFT, the token times (TBT).
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import common as C
import numpy as np


class StepRecorder:
    """Wraps the engine's executor.execute (an instance attribute shadowing the method; any
    tensor_parallel_size) to record what each step scheduled — decode rows, prefill
    token-layers, each prefill chunk as [tokens, start, layer_start, layer_end] — and the
    step's anatomy: seconds inside execute (launch + device until the token copy) and the
    Triton kernels compiled during it (run_trace adds the step's cudaMalloc calls, read
    outside the timed step). A step much slower than its work shows here why: host-side,
    compiling, or allocating."""

    def __init__(self, runner, num_layers: int, count_loads: bool = False,
                 profile_steps: Sequence[int] = ()) -> None:
        self.runner = runner
        self.num_layers = num_layers
        # count_loads: also read the two-tier cache's load counter after each step (one small
        # device read, as the server does after every step) into history's "pages_loaded"
        self.count_loads = count_loads
        self._loaded = None
        # profile_steps: indices (in this recorder's life) of steps whose execute runs under
        # torch.profiler; their history entries carry a "profile" summary (`profiled`)
        self.profile_steps = set(profile_steps)
        self.last: dict = {}
        self.history: list[dict] = []  # per step: decode rows, prefill token-layers, exec_s
        # execute (a step to its tokens) and, with async scheduling, launch (a step without
        # waiting: its exec_s is host time only) are recorded alike
        self._originals = {"execute": runner.execute, "launch": getattr(runner, "launch", None)}
        self.compiled: list[str] = []  # names of the Triton kernels compiled so far

    def _on_compile(self, *args, **kwargs):
        self.compiled.append(str(kwargs.get("repr", "?")).split("[")[0])

    def _execute(self, out, fn=None):
        fn = fn or self._originals["execute"]
        pre_chunks = [c for c in out.chunks if not c.is_decode]
        self.last = {"decode": len(out.chunks) - len(pre_chunks),
                     "prefill_token_layers": sum(c.num_tokens * (c.layer_end - c.layer_start)
                                                 for c in pre_chunks),
                     "prefill_chunks": len(pre_chunks),
                     "chunks": [[c.num_tokens, c.start, c.layer_start, c.layer_end]
                                for c in pre_chunks]}
        c0 = len(self.compiled)
        self._replay_s = 0.0
        t0 = time.perf_counter()
        prof = None
        try:
            if len(self.history) in self.profile_steps:
                result, prof = profiled(lambda: fn(out))
                return result
            return fn(out)
        finally:
            self.last.update(exec_s=time.perf_counter() - t0, compiled=self.compiled[c0:],
                             replay_s=self._replay_s)
            entry = {k: self.last[k] for k in ("decode", "prefill_token_layers", "exec_s")}
            if self.count_loads:
                tier = self.runner.offload_stats()
                loaded = tier["pages_loaded_total"] if tier else 0
                entry["pages_loaded"] = loaded - (self._loaded if self._loaded is not None
                                                  else loaded)
                self._loaded = loaded
            if prof is not None:
                entry["profile"] = prof
            self.history.append(entry)

    def _timed_replay(self, graph):
        """CUDAGraph.replay, its host time summed into the step's "replay_s" (the launch: the
        GPU may sit idle while a graph of many nodes is submitted)."""
        t = time.perf_counter()
        try:
            return self._replay(graph)
        finally:
            self._replay_s += time.perf_counter() - t

    def __enter__(self):
        import torch
        self.runner.execute = self._execute
        if self._originals["launch"] is not None:
            self.runner.launch = lambda out: self._execute(out, self._originals["launch"])
        self._hook = _set_compile_hook(self._on_compile)
        self._replay_s = 0.0
        self._replay = torch.cuda.CUDAGraph.replay
        torch.cuda.CUDAGraph.replay = lambda g: self._timed_replay(g)
        return self

    def __exit__(self, *exc):
        import torch
        self.runner.__dict__.pop("execute", None)
        self.runner.__dict__.pop("launch", None)
        _set_compile_hook(self._hook)
        torch.cuda.CUDAGraph.replay = self._replay


def summarize_steps(history: list[dict], num_layers: int, duration_s: float) -> dict:
    """Where a run's time went, from StepRecorder.history: the steps that only decode and the
    steps that carry prefill work (their count, mean seconds inside execute, mean decode rows),
    prefill tokens per second of those steps, and the share of the run's duration spent
    outside execute (scheduling, output handling, idle waiting for arrivals)."""
    pure = [s for s in history if not s["prefill_token_layers"]]
    mixed = [s for s in history if s["prefill_token_layers"]]
    exec_total = sum(s["exec_s"] for s in history)

    def part(steps: list[dict]) -> dict:
        secs = sum(s["exec_s"] for s in steps)
        out = {"steps": len(steps), "exec_s": secs,
               "mean_ms": 1e3 * secs / len(steps) if steps else None,
               "mean_decode_rows": (sum(s["decode"] for s in steps) / len(steps)
                                    if steps else None)}
        if steps and "pages_loaded" in steps[0]:
            out["pages_loaded_per_step"] = sum(s["pages_loaded"] for s in steps) / len(steps)
        return out
    mixed_part = part(mixed)
    tokens = sum(s["prefill_token_layers"] for s in mixed) / num_layers
    mixed_part["prefill_tokens"] = tokens
    mixed_part["prefill_tokens_per_s"] = tokens / mixed_part["exec_s"] if mixed else None
    return {"steps": len(history), "exec_s": exec_total,
            "outside_exec_s": max(0.0, duration_s - exec_total),
            "decode_only": part(pure), "with_prefill": mixed_part}


def prefill_work(steps: dict, prompt_tokens) -> dict:
    """From summarize_steps' record of a run and the prompt tokens of the requests it served
    (the server's `prompt_tokens` counter): `prefill_run_x` = prompt
    tokens prefilled / the served requests' prompt tokens (> 1: preempted prompts recomputed),
    `useful_prefill_tok_s` = those prompt tokens / the seconds of the steps with prefill work
    (the rate that moves requests out of the queue; None without the counters)."""
    w = steps["with_prefill"]
    if not prompt_tokens or not w["steps"]:
        return {"prefill_run_x": None, "useful_prefill_tok_s": None}
    return {"prefill_run_x": w["prefill_tokens"] / prompt_tokens,
            "useful_prefill_tok_s": prompt_tokens / w["exec_s"]}


def _set_compile_hook(hook):
    """Install Triton's post-compile hook (called once per kernel compiled); -> the previous
    one. No-op without Triton's knobs."""
    try:
        from triton import knobs
    except ImportError:
        return None
    prev = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = hook
    return prev


def _device_allocs() -> int:
    """cudaMalloc calls of the caching allocator so far (0 without CUDA)."""
    import torch
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("num_device_alloc", 0))


def step_range(text: str) -> list[int]:
    """'A:B[,C:D...]' -> the step indices A..B-1, C..D-1, ... (argparse type of --profile-steps)."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition(":")
        try:
            out.extend(range(int(a), int(b)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected A:B[,C:D...] (step indices), got {text!r}") from None
    return out


def profiled(fn, top: int = 40) -> tuple[Any, dict]:
    """fn() under torch.profiler (CPU + CUDA); -> (its result, summary): the kernel time (sum
    of device self time, ms), the `top` kernels / CPU ops by self time, and the calls of
    host-blocking CUDA APIs (synchronize, malloc, host-to-device copies)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        result = fn()
        C.synchronize("cuda" if torch.cuda.is_available() else "cpu")
    wall_ms = 1e3 * (time.perf_counter() - t0)
    ev = prof.key_averages()
    dev_us = lambda e: getattr(e, "self_device_time_total", 0) or 0  # noqa: E731
    # device-side events only (kernels, memcpys): aten ops report their kernels' time too
    on_device = lambda e: getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU  # noqa: E731
    kernels = sorted((e for e in ev if dev_us(e) > 0 and on_device(e)), key=dev_us, reverse=True)
    cpu = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)
    api = {e.key: [e.count, round(e.cpu_time_total / 1e3, 2)] for e in ev
           if any(w in e.key for w in ("Synchronize", "Malloc", "Free", "HostRegister"))}
    return result, {
        "wall_ms": round(wall_ms, 2),
        "kernel_ms": round(sum(dev_us(e) for e in kernels) / 1e3, 2),
        "kernels": sum(e.count for e in kernels),
        "top_kernels": [[e.key[:80], e.count, round(dev_us(e) / 1e3, 2)] for e in kernels[:top]],
        "top_cpu": [[e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 2)]
                    for e in cpu[:top]],
        "blocking_api": api}


def profiled_step(engine, top: int = 40) -> tuple[list, dict]:
    """engine.step() under torch.profiler: `profiled`."""
    return profiled(engine.step, top)


def run_trace(engine, trace: list[dict], device: str, stop_at: float,
              profile_steps=()) -> dict:
    """trace: [{"prompt_token_ids": [...], "max_tokens": n}]. -> metrics + per-step records.
    profile_steps: step indices run under torch.profiler (diagnosis; they run slower), each
    record then carries a "profile" summary (profiled_step)."""
    from sparseserve import SamplingParams

    L = engine.config.model.num_hidden_layers
    stats0 = engine.get_stats()
    token_times: dict[str, list[float]] = {}
    ids = [f"r{i}" for i in range(len(trace))]
    steps: list[dict] = []
    truncated = False
    C.synchronize(device)
    t0 = time.perf_counter()
    pending = sorted(zip(ids, trace), key=lambda x: x[1].get("arrival_s", 0.0), reverse=True)

    def admit(now: float) -> None:
        while pending and pending[-1][1].get("arrival_s", 0.0) <= now:
            rid, req = pending.pop()
            engine.add_request(rid, {"prompt_token_ids": req["prompt_token_ids"]},
                               SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                                              ignore_eos=True))

    admit(0.0)
    loaded_prev = stats0.get("pages_loaded_total", 0)
    wait_prev = stats0.get("save_wait_seconds_total", 0.0)
    with StepRecorder(engine.executor, L) as rec:
        while pending or engine.has_unfinished_requests():
            admit(time.perf_counter() - t0)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, pending[-1][1]["arrival_s"] - (time.perf_counter() - t0)))
                continue
            if time.perf_counter() > stop_at:
                waiting = {rid for rid, _ in pending}
                engine.abort_request([r for r in ids if r not in waiting])
                pending.clear()
                truncated = True
                break
            allocs0 = _device_allocs()  # memory_stats() builds a dict: not inside the timing
            ts = time.perf_counter()
            prof = None
            if len(steps) in profile_steps:
                outs, prof = profiled_step(engine)
            else:
                outs = engine.step()
            if not engine.config.async_scheduling:  # it keeps a step in flight on purpose
                C.synchronize(device)
            now = time.perf_counter()
            for o in outs:
                times = token_times.setdefault(o.request_id, [])
                n_new = len(o.outputs[0].token_ids) - len(times)
                times.extend([now - t0] * n_new)
            # a step late, without a host sync (what the server's loop reads after a step)
            st = engine.get_stats(fresh=False)
            loaded = st.get("pages_loaded_total", 0)
            steps.append({**rec.last, "t": now - t0, "wall_s": now - ts,
                          "device_allocs": _device_allocs() - allocs0,
                          "pages_loaded": loaded - loaded_prev,
                          "save_wait_s": st.get("save_wait_seconds_total", 0.0) - wait_prev,
                          "running": st["num_running"], "waiting": st["num_waiting"],
                          "waiting_for_slots": st.get("num_waiting_for_slots", 0),
                          "estimated_working_set": st.get("estimated_working_set", 0)})
            if prof is not None:
                steps[-1]["profile"] = prof
            loaded_prev = loaded
            wait_prev = st.get("save_wait_seconds_total", 0.0)
    wall = time.perf_counter() - t0
    stats1 = engine.get_stats()
    return summarize_run(trace, ids, token_times, steps, wall, L, stats0, stats1, truncated)


def summarize_run(trace, ids, token_times, steps, wall, L, stats0, stats1, truncated) -> dict:
    out_tokens = sum(len(token_times.get(r, [])) for r in ids)
    arrival = {r: t.get("arrival_s", 0.0) for r, t in zip(ids, trace)}
    ttft = [token_times[r][0] - arrival[r] for r in ids if token_times.get(r)]
    tbt = [b - a for r in ids for a, b in zip(token_times.get(r, []), token_times.get(r, [])[1:])]
    prompt_total = sum(len(t["prompt_token_ids"]) for t in trace)
    pre_steps = [s for s in steps if s.get("prefill_token_layers")]
    pre_tokens = sum(s["prefill_token_layers"] for s in steps) / L
    pure = [s for s in steps if not s.get("prefill_token_layers") and s.get("decode")]
    delta = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in
             ("num_preemptions_total", "pages_loaded_total", "bytes_loaded_total",
              "bytes_saved_total", "cache_hits_total", "cache_misses_total")}
    hits, misses = delta["cache_hits_total"], delta["cache_misses_total"]
    return {
        "wall_s": wall, "num_steps": len(steps), "truncated_by_time_budget": truncated,
        "completed": sum(1 for r, t in zip(ids, trace)
                         if len(token_times.get(r, [])) == t["max_tokens"]),
        "num_requests": len(ids),
        "prompt_tokens": prompt_total, "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (prompt_total + out_tokens) / wall,
        "ttft_s": C.summarize(ttft), "tbt_ms": C.summarize(tbt, 1e3),
        "p99_tbt_ms": float(np.percentile(tbt, 99) * 1e3) if tbt else None,
        "prefill_tokens_processed": pre_tokens,
        "recomputed_tokens": max(0.0, pre_tokens - prompt_total),
        "prefill_tokens_per_s_in_prefill_steps": (
            pre_tokens / sum(s["wall_s"] for s in pre_steps) if pre_steps else None),
        "pure_decode_steps": len(pure),
        "pure_decode_ms_per_step": (1e3 * float(np.mean([s["wall_s"] for s in pure]))
                                    if pure else None),
        "pure_decode_mean_batch": float(np.mean([s["decode"] for s in pure])) if pure else None,
        "mean_decode_batch": (float(np.mean([s["decode"] for s in steps if s.get("decode")]))
                              if any(s.get("decode") for s in steps) else None),
        "pages_loaded_per_decode_step": (
            float(np.mean([s["pages_loaded"] for s in steps if s.get("decode")]))
            if any(s.get("decode") for s in steps) else 0.0),
        "steps_with_requests_waiting_for_slots": sum(1 for s in steps if s["waiting_for_slots"]),
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        **{k.replace("_total", ""): v for k, v in delta.items()},
        "steps": steps,
    }
