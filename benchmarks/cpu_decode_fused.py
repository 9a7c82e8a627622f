"""The CPU decode attention's paths, interleaved: per layer, and in the engine.

``--mode layer``: per layer, batch 16 x 3 KV heads x 3 query heads (SmolLM2), D 64, page size
16, one thread, fp32, the caches of 16 layers cycled (cold-ish), page layout as in
benchmarks/cpu_decode_views.py (each prompt's pages consecutive per head, decode pages
scattered). Paths:

* ``torch``: the torch path (``paged_decode_cpu.decode_planned`` with its plan: K gathered by
  index_select, bmm, V summed by embedding_bag);
* ``fused``: the C++ kernel (``paged_decode_cpu_fused``, AVX-512 path where built);
* ``sdpa``: torch's CPU flash attention (``F.scaled_dot_product_attention``, GQA flag) over K
  and V gathered with index_select, dropped tokens masked by an additive -inf mask;
* ``sdpa_fold``: the same with the G query heads of a KV head as G query rows of one head
  (no GQA flag, a boolean mask).

Calls interleaved (order alternating, different layers' caches), medians of per-call ratios
to ``torch``.

``--mode engine``: one engine (the HF folder, fp32, greedy, 1 thread), the two paths switched
in-process (``paged_decode_cpu_fused.set_enabled``), rounds in alternating order: the batch-16
decode step from 16 x 500-token prompts with 1 and with ``--steps`` + 1 outputs, and the
batch-1 step from a 32-token prompt with 1 and 129 outputs; greedy tokens compared.

    python benchmarks/cpu_decode_fused.py --mode layer --out docs/results/data/cpu_decode_fused_layer.json
    OMP_NUM_THREADS=1 python benchmarks/cpu_decode_fused.py --mode engine --model /work/smollm2-hf \\
        --out docs/results/data/cpu_decode_fused_engine.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from cpu_ab import fused_vs_torch  # noqa: E402
from cpu_decode_views import B, D, G, HKV, PS, layout  # noqa: E402

from sparseserve.kernels import paged_decode_cpu_fused as fused_kernel  # noqa: E402
from sparseserve.kernels.paged_decode_cpu import decode_planned, plan_decode  # noqa: E402

LAYERS = 16


def sdpa(q, kc, vc, plan, mask_add, scale, fold):
    """q [B, Hq, D] over K / V gathered by the torch plan's page ids -> [B, Hq, D]."""
    N = plan.drop_s.shape[-1]
    k = kc.index_select(0, plan.page_ids).view(B, HKV, N, D)
    v = vc.index_select(0, plan.page_ids).view(B, HKV, N, D)
    if fold:
        o = F.scaled_dot_product_attention(q.view(B, HKV, G, D), k, v,
                                           attn_mask=plan.drop_s.logical_not(), scale=scale)
    else:
        o = F.scaled_dot_product_attention(q.view(B, HKV * G, 1, D), k, v, attn_mask=mask_add,
                                           scale=scale, enable_gqa=True)
    return o.reshape(B, HKV * G, D)


def run_layer(L: int, reps: int) -> dict:
    table, npg, last, P, _ = layout(L)
    kcs = [torch.randn(P, PS, D) for _ in range(LAYERS)]
    vcs = [torch.randn(P, PS, D) for _ in range(LAYERS)]
    qs = [torch.randn(B, HKV * G, D) for _ in range(LAYERS)]
    plan = plan_decode(table, npg, last, PS, G, fused=False)
    N = plan.drop_s.shape[-1]
    mask_add = torch.zeros(B, HKV, 1, 1, N).masked_fill_(plan.drop_s.unsqueeze(2), float("-inf"))
    mask_add = mask_add.expand(B, HKV, G, 1, N).reshape(B, HKV * G, 1, N)
    fs = {"torch": lambda i: decode_planned(qs[i], kcs[i], vcs[i], plan, 0.125),
          "sdpa": lambda i: sdpa(qs[i], kcs[i], vcs[i], plan, mask_add, 0.125, False),
          "sdpa_fold": lambda i: sdpa(qs[i], kcs[i], vcs[i], plan, None, 0.125, True)}
    if fused_kernel.available():
        fs["fused"] = lambda i: fused_kernel.paged_decode_fused(qs[i], kcs[i], vcs[i], table,
                                                                npg, last, 0.125)
    for k, f in fs.items():  # same results as the torch path
        assert torch.allclose(f(0), fs["torch"](0), atol=1e-5), k
    names = list(fs)
    ts = {k: [] for k in names}
    for rep in range(reps):
        for j, k in enumerate(names if rep % 2 == 0 else names[::-1]):
            i = (rep * len(names) + j) % LAYERS
            t = time.perf_counter()
            fs[k](i)
            ts[k].append(time.perf_counter() - t)
    return {k: {"median_ms": statistics.median(ts[k]) * 1e3,
                "ratio_to_torch": statistics.median(b / a for a, b in zip(ts["torch"], ts[k]))}
            for k in names}


def run_engine(model: str, rounds: int, steps: int) -> dict:
    from sparseserve import LLM, SamplingParams
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=2304, max_num_seqs=16)
    many = [[11 + (i * 13 + j * 7) % 1500 for j in range(500)] for i in range(16)]
    one = [[5 + j % 400 for j in range(32)]]

    def gen(prompts, n):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def timed(prompts, n):
        t = time.perf_counter()
        toks = gen(prompts, n)
        return time.perf_counter() - t, toks

    fused_kernel.set_enabled(True)
    gen(one, 4)  # warm-up (and the kernel's build or load)
    samples, tokens = [], {}
    for r in range(rounds):
        order = ["fused", "torch"] if r % 2 == 0 else ["torch", "fused"]
        for path in order:
            fused_kernel.set_enabled(path == "fused")
            t1, _ = timed(one, 1)
            tn, tok1 = timed(one, 129)
            m1, _ = timed(many, 1)
            mn, tokm = timed(many, steps + 1)
            s = {"round": r, "path": path, "b1_step_ms": 1e3 * (tn - t1) / 128,
                 "b16_step_ms": 1e3 * (mn - m1) / steps, "many_1_s": m1,
                 f"many_{steps + 1}_s": mn}
            samples.append(s)
            tokens[path] = (tok1, tokm)
            print(json.dumps(s), flush=True)
    fused_kernel.set_enabled(True)
    return fused_vs_torch(samples, ("b1_step_ms", "b16_step_ms"), tokens["fused"] == tokens["torch"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=["layer", "engine"], default="layer")
    ap.add_argument("--lengths", type=int, nargs="+", default=[513, 576, 640])
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--model", default="/work/smollm2-hf")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"mode": args.mode, "threads": 1, "fused_built": fused_kernel.available(),
           "fused_isa": fused_kernel.vector_isa()}
    if args.mode == "layer":
        res.update(batch=B, kv_heads=HKV, groups=G, head_dim=D, page_size=PS, reps=args.reps,
                   by_length={})
        for L in args.lengths:
            res["by_length"][L] = r = run_layer(L, args.reps)
            print(L, "  ".join(f"{k} {v['median_ms']:.3f} ms ({v['ratio_to_torch']:.3f}x)"
                               for k, v in r.items()), flush=True)
    else:
        res.update(model=args.model, rounds=args.rounds, steps=args.steps,
                   **run_engine(args.model, args.rounds, args.steps))
        print(json.dumps({k: res[k] for k in ("b1_step_ms", "b16_step_ms", "same_tokens")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
