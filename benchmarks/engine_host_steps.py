"""The engine's host work per step, A/B across source trees: an offline decode-heavy run of a
2-layer dummy Llama (hidden 256; its model math is small, so the scheduler, the output side and
the runner's per-step preparation are most of a step, as on a GPU behind CUDA graphs), each tree
in its own process, rounds interleaved, medians and ratios to the first tree.

  git worktree add /tmp/base 7422f95
  python benchmarks/engine_host_steps.py --out /tmp/host.json --trees /tmp/base,. \\
      --batches 16,64 --output-len 256 --rounds 3

`--logprobs K` asks every request for K logprobs (what `bench serve` does with token-id
prompts: K = 0).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def worker(args) -> None:
    """One tree (on sys.path first): ms per engine step for each batch size."""
    import torch

    import common as C
    from sparseserve import LLM, SamplingParams

    torch.set_num_threads(1)
    ns = argparse.Namespace(model=None, smoke=True)
    path, _, _ = C.resolve_model(ns, args.tmp, 1024)
    llm = LLM(path, load_format="dummy", device="cpu", dtype="float32", max_model_len=1024,
              max_num_seqs=max(args.batches), kv_cache_memory_bytes=256 << 20, seed=0)
    res = {}
    for b in args.batches:
        prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 2000 for j in range(64)]}
                   for i in range(b)]
        p = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                           logprobs=args.logprobs)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        steps0 = llm.engine.step_count
        t = time.perf_counter()
        llm.generate(prompts, p, use_tqdm=False)
        res[str(b)] = 1e3 * (time.perf_counter() - t) / (llm.engine.step_count - steps0)
    with open(args.worker_out, "w") as f:
        json.dump(res, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--trees", default=".", help="comma list of source trees (first = baseline)")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",")]
    if a.worker_out:
        worker(a)
        return 0
    import common as C

    trees = [os.path.abspath(t) for t in a.trees.split(",")]
    result = {"meta": C.meta(argv), "settings": vars(a), "samples": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for tree in (trees if r % 2 == 0 else trees[::-1]):
                out = os.path.join(tmp, "w.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker-out", out, "--tmp", tmp,
                       "--batches", ",".join(map(str, a.batches)), "--output-len", str(a.output_len)]
                if a.logprobs is not None:
                    cmd += ["--logprobs", str(a.logprobs)]
                # cwd and PYTHONPATH: the tree's sparseserve is imported, not this checkout's
                subprocess.run(cmd, cwd=tree, check=True, capture_output=True,
                               env=dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1"))
                with open(out) as f:
                    ms = json.load(f)
                result["samples"].append({"round": r, "tree": tree, "ms_per_step": ms})
                print(f"round {r} {tree}: " + " ".join(f"b{b}={v:.2f} ms" for b, v in ms.items()),
                      flush=True)
                if a.out:
                    C.write_json(a.out, result)
    rows = []
    base = None
    for tree in trees:
        ss = [s["ms_per_step"] for s in result["samples"] if s["tree"] == tree]
        med = {b: statistics.median(s[b] for s in ss) for b in ss[0]}
        result.setdefault("medians", {})[tree] = med
        base = base or med
        rows.append([tree] + [f"{med[b]:.2f} ({med[b] / base[b]:.2f}x)" for b in med])
    if a.out:
        C.write_json(a.out, result)
    print(C.table(["tree"] + [f"ms/step b={b}" for b in base], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
