"""The CPU engine's torch thread count, idle and under load (the thread policy of the
step-efficiency issue): decode ms per step at batch 1 and 8 and a prefill's tokens/s on the
embedded SmolLM2 (fp32, greedy, dense), for each thread count, with the machine otherwise idle
and with competing work (`--load-procs` processes doing numpy matmuls, standing in for the
server, a tokenizer, or another tenant), and for the engine's own per-step policy
(`policy`: worker/cpu_threads.py). Thread counts and load states are interleaved round by
round (the machine is shared: ratios within a round are what to read).

    python benchmarks/cpu_threads.py --out docs/results/data/cpu_threads.json
    python benchmarks/cpu_threads.py --out /tmp/t.json --smoke
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402


def _burn(stop) -> None:
    import numpy as np
    a = np.random.default_rng(0).standard_normal((256, 256))
    while not stop.is_set():
        a = a @ a
        a /= np.abs(a).max() + 1.0


def measure(llm, threads, decode_steps: int, prefill_len: int, batches) -> dict:
    """ms per decode step at each batch (prompt of 32 tokens, `decode_steps` outputs, minus a
    1-token run) and prefill tokens/s of one `prefill_len`-token prompt, at `threads` (an int:
    fixed, the engine's policy off; "policy": the engine's per-step policy,
    worker/cpu_threads.py)."""
    import torch

    from sparseserve import SamplingParams
    policy = llm.engine.runner.cpu_threads
    policy.enabled = threads == "policy"
    if threads != "policy":
        torch.set_num_threads(threads)
    out = {}
    for b in batches:
        prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 400 for j in range(32)]}
                   for i in range(b)]
        # one untimed pass first: the first generate of a shape pays one-off costs (allocator,
        # kernel selection) that would otherwise land in the 1-token run and make the
        # difference below meaningless (negative in short runs)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
        times = []
        for n in (1, decode_steps + 1):
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                         use_tqdm=False)
            times.append(time.perf_counter() - t)
        out[f"decode_ms_b{b}"] = 1e3 * (times[1] - times[0]) / decode_steps
    prompt = [{"prompt_token_ids": [5 + j % 400 for j in range(prefill_len)]}]
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    out["prefill_tok_s"] = prefill_len / (time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", default=None,
                   help="comma list of counts and/or 'policy' (default: 1..cores,policy)")
    p.add_argument("--load-procs", type=int, default=1, help="competing processes when loaded")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--prefill-len", type=int, default=1000)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--smoke", action="store_true", help="tiny random model, one short round")
    args = p.parse_args(argv)
    import tempfile

    from sparseserve import LLM
    cores = os.cpu_count() or 1
    spec = args.threads or ",".join([*map(str, range(1, cores + 1)), "policy"])
    threads = [x if x == "policy" else int(x) for x in spec.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    tmp = tempfile.TemporaryDirectory()
    model = None
    if args.smoke:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.tiny_models import make_tiny_model
        model = os.path.join(tmp.name, "tiny")
        make_tiny_model(model)
        args.rounds, args.decode_steps, args.prefill_len = 1, 4, 64
    llm = LLM(model, device="cpu", max_model_len=args.prefill_len + 64,
              max_num_seqs=max(batches))
    result = {"meta": C.meta(argv), "settings": {**vars(args), "cores": cores},
              "samples": []}
    for r in range(args.rounds):
        for loaded in (False, True):
            stop = mp.Event()
            procs = []
            if loaded:
                procs = [mp.Process(target=_burn, args=(stop,), daemon=True)
                         for _ in range(args.load_procs)]
                for pr in procs:
                    pr.start()
                time.sleep(0.5)
            try:
                for t in threads:
                    m = measure(llm, t, args.decode_steps, args.prefill_len, batches)
                    result["samples"].append({"round": r, "loaded": loaded, "threads": t, **m})
                    C.write_json(args.out, result)
            finally:
                stop.set()
                for pr in procs:
                    pr.join(5)
    keys = [k for k in result["samples"][0] if k.startswith("decode") or k == "prefill_tok_s"]
    summary = []
    for loaded in (False, True):
        for t in threads:
            s = [x for x in result["samples"] if x["loaded"] == loaded and x["threads"] == t]
            summary.append({"loaded": loaded, "threads": t,
                            **{k: statistics.median(x[k] for x in s) for k in keys}})
    result["summary"] = summary
    C.write_json(args.out, result)
    print(f"wrote {args.out}\n")
    print(C.table(["load", "threads", *keys],
                  [["busy" if s["loaded"] else "idle", s["threads"],
                    *[C.fmt(s[k], 1) for k in keys]] for s in summary]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
