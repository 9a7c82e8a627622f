"""Torch ops per decode step of the eager engine on the CPU (embedded SmolLM2-135M, fp32, greedy).

Each op call is a launch on the GPU's eager / hybrid path and interpreter overhead on the
CPU, so the count per decode step (and per layer) is the number to push down. For each batch
size: a short prompt per request, prefill, a few warm-up decode steps, then
  * ms per step (wall, median) over ``--steps`` decode steps,
  * op counts per step over ``--count-steps`` steps: aten ops seen by a TorchDispatchMode
    (what actually runs: composite ops decomposed, views included), and torch.profiler's
    aten:: events (all nesting levels, and top-level only), with the top ops by count
    (dispatch) and by self CPU time (profiler).

    python benchmarks/cpu_decode_ops.py --out /tmp/cpu_decode_ops.json
    python benchmarks/cpu_decode_ops.py --time-only --batches 1 --steps 40   # timing only
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

PROMPT = "Write one sentence about the sea, then one about the mountains, then one about"


class OpCounter:
    """TorchDispatchMode counting every aten op call (by overload packet name)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[str(func.overloadpacket)] += 1
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _engine(batch: int, prompt_tokens: int, max_tokens: int):
    from sparseserve import LLM, SamplingParams

    llm = LLM(max_num_seqs=max(8, batch), max_model_len=1024)
    eng = llm.engine
    ids = eng.tokenizer.encode(PROMPT)
    ids = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
    for i in range(batch):
        # distinct prompts per row (one token differs) so rows are independent requests
        eng.add_request(str(i), {"prompt_token_ids": ids[:-1] + [ids[-1] + i]},
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in eng.scheduler.requests.values()):
        eng.step()
    return llm, eng


def measure(batch: int, a) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(a.threads)
    total = a.warmup + a.steps + 2 * a.count_steps + 4
    llm, eng = _engine(batch, a.prompt_tokens, total)
    layers = eng.config.model.num_hidden_layers
    for _ in range(a.warmup):
        eng.step()
    walls = []
    for _ in range(a.steps):
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    walls.sort()
    res = {"batch": batch, "layers": layers, "prompt_tokens": a.prompt_tokens,
           "ms_per_step_median": 1e3 * walls[len(walls) // 2],
           "ms_per_step_min": 1e3 * walls[0]}
    if a.time_only:
        eng.shutdown()
        return res
    with OpCounter() as oc:
        for _ in range(a.count_steps):
            eng.step()
    n = a.count_steps
    disp = sum(oc.counts.values()) / n
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.count_steps):
            eng.step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top_level = [e for e in events
                 if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    by_self = sorted((e for e in prof.key_averages() if e.key.startswith("aten::")),
                     key=lambda e: -e.self_cpu_time_total)
    eng.shutdown()
    res.update({
        "dispatch_ops_per_step": disp,
        "dispatch_ops_per_layer": disp / layers,
        "profiler_aten_events_per_step": len(events) / n,
        "profiler_toplevel_aten_per_step": len(top_level) / n,
        "top_ops_by_count": [{"op": k, "per_step": v / n}
                             for k, v in oc.counts.most_common(a.top)],
        "top_ops_by_self_time": [{"op": e.key, "calls_per_step": e.count / n,
                                  "self_us_per_step": e.self_cpu_time_total / n}
                                 for e in by_self[:a.top]],
    })
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="JSON result path")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed decode steps")
    p.add_argument("--count-steps", type=int, default=3, help="op-counted decode steps")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: on a shared, busy 2-core box a parallel "
                        "op waits milliseconds for its second thread)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--time-only", action="store_true", help="skip the op counts")
    a = p.parse_args(argv)
    import sparseserve
    res = {"command": "python " + " ".join(sys.argv), "args": vars(a),
           "sparseserve": os.path.dirname(sparseserve.__file__), "results": []}
    for b in (int(x) for x in a.batches.split(",")):
        res["results"].append(measure(b, a))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    print(f"{'batch':>5} {'ms/step':>8} {'ops/step':>9} {'ops/layer':>9} {'prof aten':>9} "
          f"{'prof top':>8}")
    for r in res["results"]:
        if a.time_only:
            print(f"{r['batch']:>5} {r['ms_per_step_median']:8.2f}")
            continue
        print(f"{r['batch']:>5} {r['ms_per_step_median']:8.2f} {r['dispatch_ops_per_step']:9.0f} "
              f"{r['dispatch_ops_per_layer']:9.1f} {r['profiler_aten_events_per_step']:9.0f} "
              f"{r['profiler_toplevel_aten_per_step']:8.0f}")
    for r in res["results"]:
        if a.time_only:
            continue
        print(f"\nbatch {r['batch']}: top ops by count (per step)")
        print("  " + ", ".join(f"{o['op'].removeprefix('aten.')} {o['per_step']:.0f}"
                               for o in r["top_ops_by_count"][:14]))
        print(f"batch {r['batch']}: top ops by self CPU time (us per step, calls)")
        print("  " + ", ".join(f"{o['op'].removeprefix('aten::')} {o['self_us_per_step']:.0f}us"
                               f"/{o['calls_per_step']:.0f}" for o in r["top_ops_by_self_time"][:10]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
