"""Graph replay against eager, step by step, on an end-to-end trace: the instrument for CUDA-
graph faults of the two-tier decode (the end-to-end issue's: eager runs of mix40 were clean,
graph runs hit an illegal address within seconds; the cause was a buffer an algorithm replaced
between calls — see docs/results/system.md).

Every call of the decode graphs (pure decode and hybrid steps) runs twice from the same state:
first the captured forward op by op (`DecodeGraphs._forward(b)`: the same bucket, padding rows
and static buffers as the graph), then — with the state restored — the graph replay, followed
by a device synchronisation, so a fault is attributed to the replay it happened in. The two
resulting states (graph_state.tracked_state: the cache's bookkeeping, device KV, summaries)
must be identical bit for bit, and so must the logits; the run goes on from the replay's
state. The first step that differs, or whose bookkeeping holds an id no kernel may follow, is
reported with its batch (rows, positions, bucket) and the first differing positions. Records
are written after every checked step (a fault aborts the process).

  python benchmarks/graph_check.py --out $OUT/graph_check.json --num-layers 4 \\
      --kv-cache-memory-bytes 1073741824          # H200: Llama-3-8B widths, 4 layers
  python benchmarks/graph_check.py --out /tmp/g.json --smoke   # CPU: eager vs eager
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import engine_bench as E  # noqa: E402
import graph_state as G  # noqa: E402
import system as S  # noqa: E402
import torch  # noqa: E402
from sparseserve.transfer.common import bits_view  # noqa: E402

GiB = 1 << 30


class GraphChecker:
    """Wraps DecodeGraphs.run (or, without graphs, runs eager twice: the smoke) and compares."""

    def __init__(self, runner, record, save, max_checked: int) -> None:
        self.runner, self.record, self.save = runner, record, save
        self.max_checked = max_checked
        self.state = G.tracked_state(runner)
        off = runner.offload
        self.bounds = None if off is None else (off.num_slots, off.num_host_pages,
                                                off.num_rows)
        self.checked = 0

    def replay_checked(self, graphs, input_ids, positions, rows, fills=True):
        """DecodeGraphs.run's contract, with the eager twin (the same `fills` variant) run
        first from the same state."""
        n = input_ids.shape[0]
        b = graphs.stage(input_ids, positions, rows)
        key = (b, fills or len(graphs.variants) == 1)
        if self.checked >= self.max_checked:
            graphs.graphs[key].replay()
            return graphs.logits[key][:n]
        before = G.snapshot(self.state)
        eager_logits = graphs._forward(*key)[:n].clone()
        eager = G.snapshot(self.state)
        G.restore(self.state, before)
        del before
        graphs.graphs[key].replay()
        torch.cuda.synchronize()  # a fault here is this replay's
        self._compare(n, b, rows, positions, eager, eager_logits, graphs.logits[key][:n])
        return graphs.logits[key][:n]

    def _compare(self, n, b, rows, positions, eager, eager_logits, graph_logits) -> None:
        self.checked += 1
        graph = G.snapshot(self.state)
        off = self.runner.offload
        if off is not None:
            # padding rows all store their token into the scratch slot: which one lands last
            # is not defined, so that slot is no evidence
            for snap in (eager, graph):
                for name, t in snap.items():
                    if name.startswith(("dev_k.", "dev_v.")):
                        t[off.scratch_slot].zero_()
        diffs = G.diff_states(eager, graph)
        if not torch.equal(bits_view(eager_logits), bits_view(graph_logits)):
            d = (eager_logits - graph_logits).abs()
            diffs["logits"] = {"count": int((d != 0).sum()), "max_abs": float(d.max()),
                               "argmax_equal": bool(torch.equal(eager_logits.argmax(-1),
                                                                graph_logits.argmax(-1)))}
        errs = [] if self.bounds is None else G.range_errors(self.state, *self.bounds)
        rec = self.record
        rec["checked_steps"] = self.checked
        if diffs or errs:
            # bookkeeping (integer state) differing from its eager twin is the fault's trace;
            # float-only differences would be numerics (a kernel choice under capture)
            ints = sorted(k for k, v in diffs.items() if "max_abs" not in v)
            kind = "range" if errs else "bookkeeping" if ints else "numerics-only"
            rec["differing_steps"].append({
                "check": self.checked, "engine_step": rec.get("engine_step"), "kind": kind,
                "batch": n, "bucket": b, "rows": rows.tolist(),
                "positions": positions.tolist(), "diffs": diffs, "range_errors": errs})
            rec["first_" + kind] = rec.get("first_" + kind, self.checked)
            E.log(self.record["deadline"], f"check {self.checked}: batch {n} (bucket {b}) "
                  f"{kind}: {sorted(diffs)} {errs}")
        self.save()


def run(args) -> dict:
    from sparseserve import LLM

    deadline = C.Deadline(args.time_budget_s)
    result = {"meta": C.meta(args.argv), "settings": {k: v for k, v in vars(args).items()
                                                       if k != "argv"}}
    rec = {"checked_steps": 0, "differing_steps": [], "deadline": deadline}
    result["run"] = rec

    def save():
        C.write_json(args.out, {**result, "run": {k: v for k, v in rec.items()
                                                  if k != "deadline"}})

    device, dtype = E.device_and_dtype(args)
    with tempfile.TemporaryDirectory() as tmp:
        scale = 1 / 40 if args.smoke else 1.0
        if args.smoke:
            args.model = None
            model, cfg, label = C.resolve_model(args, tmp, 131072)
        else:  # Llama-3-8B widths, fewer layers: the same kernels, a small device budget
            from sparseserve.model.loader.dummy import BUILTIN_DUMMY_CONFIGS
            cfg = {**copy.deepcopy(BUILTIN_DUMMY_CONFIGS["llama-3-8b"]),
                   "num_hidden_layers": args.num_layers}
            model = os.path.join(tmp, "llama-3-8b-shallow")
            os.makedirs(model)
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump(cfg, f)
            label = f"llama-3-8b widths, {args.num_layers} layers"
        result["settings"]["model_label"] = label
        trace = S.make_trace(args.trace, cfg["vocab_size"], args.seed, scale)
        ns = argparse.Namespace(seed=args.seed, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                token_budget=args.token_budget, enforce_eager=False)
        kw = S.engine_kwargs(ns, cfg, trace, device, dtype, args.config)
        result["settings"]["engine_args"] = kw
        llm = LLM(model, **kw)
        eng = llm.engine
        runner = eng.executor.local_runner("graph check")
        checker = GraphChecker(runner, rec, save, args.max_checked_steps)
        graphs = runner.graphs
        rec["cuda_graphs"] = None if graphs is None else graphs.sizes
        if graphs is not None:
            graphs.run = lambda ids, pos, rows, fills=True: checker.replay_checked(
                graphs, ids, pos, rows, fills)
        else:
            E.log(deadline, "warning: this engine captured no CUDA graphs (CPU, or eager): "
                            "nothing to check; the trace runs unchecked")
        rec["engine_step"] = "warm-up"
        S.warmup(eng, cfg["vocab_size"], scale)
        from sparseserve import SamplingParams
        for i, req in enumerate(trace):
            eng.add_request(f"r{i}", {"prompt_token_ids": req["prompt_token_ids"]},
                            SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                                           ignore_eos=True))
        t0 = time.perf_counter()
        stop_at = t0 + min(args.run_budget_s, deadline.remaining() - 20)
        steps = 0
        try:
            while eng.has_unfinished_requests() and time.perf_counter() < stop_at:
                rec["engine_step"] = steps
                eng.step()
                steps += 1
        finally:
            rec.update(engine_steps=steps, wall_s=time.perf_counter() - t0,
                       stats={k: v for k, v in eng.get_stats().items()
                              if isinstance(v, (int, float))})
            save()
            eng.shutdown()
    return {**result, "run": {k: v for k, v in rec.items() if k != "deadline"}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result path (rewritten every check)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model on the CPU (no graphs there: the trace runs unchecked)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="sparseserve", choices=list(S.CONFIGS))
    p.add_argument("--trace", default="mix40", choices=S.TRACES)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=GiB)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--max-checked-steps", type=int, default=100000)
    p.add_argument("--time-budget-s", type=float, default=400)
    p.add_argument("--run-budget-s", type=float, default=300)
    args = p.parse_args(argv)
    args.argv = argv
    if args.smoke:
        args.kv_cache_memory_bytes = min(args.kv_cache_memory_bytes, 3 * 2**20)
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 64)
        args.token_budget = min(args.token_budget, 128)
    out = run(args)
    r = out["run"]
    print(f"\nchecked {r['checked_steps']} graph calls over {r.get('engine_steps')} engine "
          f"steps ({r.get('wall_s', 0):.1f} s); differing: {len(r['differing_steps'])}; "
          f"graphs: {r.get('cuda_graphs')}")
    for kind in ("range", "bookkeeping", "numerics-only"):
        first = r.get("first_" + kind)
        print(f"  first {kind} difference: " + ("none" if first is None else f"check {first}"))
    for d in r["differing_steps"][:5]:
        print(f"  check {d['check']} (engine step {d['engine_step']}) {d['kind']}: batch "
              f"{d['batch']} bucket {d['bucket']}: {sorted(d['diffs'])} {d['range_errors']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
