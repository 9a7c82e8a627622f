"""The CPU RMSNorm's two paths, interleaved: per call, and in the engine.

``--mode call``: ``model.layers.rms_norm`` on x [T, 576] fp32 (SmolLM2's hidden size), one
thread, with the fused C++ kernel (``rms_norm_cpu_fused``) and with ``F.rms_norm`` (the
kernel switched off); calls interleaved in alternating order, medians of per-pair ratios.
T = 1 and 16 are decode steps, 2000 a prefill.

``--mode engine``: one engine (the HF folder, fp32, greedy, 1 thread), the two paths switched
in-process (``rms_norm_cpu_fused.set_enabled``), rounds in alternating order: the batch-1
decode step from a 32-token prompt with 1 and 129 outputs, and a 2000-token prefill (one
output); greedy tokens compared.

    python benchmarks/cpu_norm_fused.py --mode call --out docs/results/data/cpu_norm_fused_call.json
    OMP_NUM_THREADS=1 python benchmarks/cpu_norm_fused.py --mode engine --model /work/smollm2-hf \\
        --rounds 6 --out docs/results/data/cpu_norm_fused_engine.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_ab import fused_vs_torch  # noqa: E402
from sparseserve.kernels import rms_norm_cpu_fused as cpu_norm  # noqa: E402
from sparseserve.model.layers import rms_norm  # noqa: E402

N = 576


def run_call(rows: list[int], reps: int) -> dict:
    torch.set_num_threads(1)
    assert cpu_norm.available(), "the kernel did not build"
    w = 1 + 0.1 * torch.randn(N)
    res = {}
    for T in rows:
        xs = [torch.randn(T, N) for _ in range(8)]  # a few inputs, like the layers' streams
        inner = max(1, 2000 // T)  # calls per sample: short ones are timed in batches
        times = {"fused": [], "torch": []}
        for i in range(reps + 5):
            order = ["fused", "torch"] if i % 2 == 0 else ["torch", "fused"]
            for path in order:
                cpu_norm.set_enabled(path == "fused")
                t = time.perf_counter()
                for j in range(inner):
                    rms_norm(xs[j % 8], w, 1e-5)
                if i >= 5:  # the first pairs warm up
                    times[path].append((time.perf_counter() - t) / inner)
        cpu_norm.set_enabled(True)
        ratios = [a / b for a, b in zip(times["fused"], times["torch"])]
        res[str(T)] = {"fused_us": 1e6 * statistics.median(times["fused"]),
                       "torch_us": 1e6 * statistics.median(times["torch"]),
                       "fused_over_torch": statistics.median(ratios)}
        print(T, json.dumps(res[str(T)]), flush=True)
    return res


def run_engine(model: str, rounds: int) -> dict:
    from sparseserve import LLM, SamplingParams
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=2304, max_num_seqs=16)
    one = [[5 + j % 400 for j in range(32)]]
    long = [[11 + (j * 13) % 1500 for j in range(2000)]]

    def timed(prompts, n):
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                            use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    cpu_norm.set_enabled(True)
    timed(one, 4)  # warm-up (and the kernels' build or load)
    samples, tokens = [], {}
    for r in range(rounds):
        order = ["fused", "torch"] if r % 2 == 0 else ["torch", "fused"]
        for path in order:
            cpu_norm.set_enabled(path == "fused")
            t1, _ = timed(one, 1)
            tn, tok1 = timed(one, 129)
            tp, tokp = timed(long, 1)
            s = {"round": r, "path": path, "b1_step_ms": 1e3 * (tn - t1) / 128,
                 "prefill_2000_s": tp}
            samples.append(s)
            tokens[path] = (tok1, tokp)
            print(json.dumps(s), flush=True)
    cpu_norm.set_enabled(True)
    return fused_vs_torch(samples, ("b1_step_ms", "prefill_2000_s"), tokens["fused"] == tokens["torch"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=["call", "engine"], default="call")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 2000])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--model", default="/work/smollm2-hf")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.mode == "call":
        res = {"mode": "call", "hidden": N, "rows": run_call(a.rows, a.reps)}
    else:
        res = {"mode": "engine", "model": a.model, "rounds": a.rounds,
               **run_engine(a.model, a.rounds)}
    res["torch"] = torch.__version__
    res["vectorised"] = cpu_norm.vectorised()
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
