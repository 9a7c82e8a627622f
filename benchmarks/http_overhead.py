"""What the HTTP server costs a streamed token: the same engine and workload through
`sparseserve bench serve` in-process (AsyncLLMEngine, no HTTP) and over HTTP against a real
`sparseserve serve` process, rounds interleaved, medians and ratios to in-process reported.

A small model makes the server's per-token work visible (an engine step of a few ms, like a
GPU decode step, instead of SmolLM2's ~60 ms on this CPU):

  python benchmarks/http_overhead.py --out /tmp/http_overhead.json --rounds 3
  # SmolLM2 (the embedded default) instead of the 2-layer dummy model
  python benchmarks/http_overhead.py --out /tmp/h.json --model /work/smollm2-hf --num-prompts 8

  # against an older tree, interleaved: its server from a worktree
  git worktree add /tmp/base 7422f95
  python benchmarks/http_overhead.py --out /tmp/h.json --configs in-process,http,http-baseline \
      --baseline-tree /tmp/base --output-len 512

`--server-args` adds flags to the server (and the in-process engine), e.g. "--async-scheduling".
Every configuration of a round runs against a fresh engine; the client always runs in this
process. On a machine with few cores the client, the server's event loop and its engine share
them: report the ratio, and pin (`--server-cpus`) to model a server with its own cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402
from serving_http import free_port, stop_server, wait_healthy  # noqa: E402

KEYS = ("output_throughput", "mean_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
        "mean_tpot_ms")


def engine_flags(a, model: str) -> list[str]:
    flags = ["--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
             "--kv-cache-memory-bytes", str(a.kv_cache_bytes), "--device", "cpu",
             "--dtype", "float32", "--seed", "0"]
    if a.load_format:
        flags += ["--load-format", a.load_format]
    return flags + shlex.split(a.server_args)


def bench_args(a, name: str, out_dir: str) -> list[str]:
    return ["bench", "serve", "--dataset-name", "random", "--tokenizer", "none",
            "--vocab-size", str(a.vocab_size), "--num-prompts", str(a.num_prompts),
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--request-rate", "inf", "--seed", "0", "--token-id-prompts", "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", out_dir, "--result-filename", name]


def run_bench(args: list[str], out_dir: str, name: str) -> dict:
    from sparseserve.cli import main

    rc = main(args)
    if rc != 0:
        raise RuntimeError(f"bench serve exited with {rc}")
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def in_process(a, model: str, out_dir: str, tag: str) -> dict:
    flags = " ".join(shlex.quote(x) for x in ["--model", model, *engine_flags(a, model)])
    args = bench_args(a, tag, out_dir) + ["--engine-args", flags]
    return run_bench(args, out_dir, tag)


def over_http(a, model: str, out_dir: str, tag: str, extra: tuple = (),
              tree: str | None = None) -> dict:
    """`tree`: run the server from another checkout's sources (the baseline of an A/B)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sparseserve.cli", "serve", model, "--port", str(port),
           "--uvicorn-log-level", "warning", *engine_flags(a, model), *extra]
    if a.server_cpus:
        cmd = ["taskset", "-c", a.server_cpus, *cmd]
    # cwd: `python -m` puts the working directory first on sys.path, before PYTHONPATH
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=tree or os.path.dirname(HERE),
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                [tree or os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])))
    try:
        wait_healthy(proc, base, 300)
        run_bench(bench_args(a, tag + "_w", out_dir) + ["--base-url", base], out_dir, tag + "_w")
        return run_bench(bench_args(a, tag, out_dir) + ["--base-url", base], out_dir, tag)
    finally:
        stop_server(proc)


def over_http_thread(a, model: str, out_dir: str, tag: str) -> dict:
    return over_http(a, model, out_dir, tag, ("--no-engine-process",))


def over_http_baseline(a, model: str, out_dir: str, tag: str) -> dict:
    return over_http(a, model, out_dir, tag, tree=a.baseline_tree)


# http: the server as shipped (its engine in its own process); http-thread: the engine stepped
# by a thread of the server process, sharing the GIL with the HTTP event loop
CONFIGS = {"in-process": in_process, "http": over_http, "http-thread": over_http_thread,
           "http-baseline": over_http_baseline}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="model folder (default: a 2-layer dummy model)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    p.add_argument("--server-args", default="", help="extra engine / server flags")
    p.add_argument("--server-cpus", default=None, help="taskset CPU list for the server process")
    p.add_argument("--baseline-tree", default=None,
                   help="a checkout (e.g. `git worktree add /tmp/base <commit>`) whose server the "
                        "http-baseline configuration runs")
    a = p.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    a.smoke = a.model is None
    model, cfg, display = C.resolve_model(a, tmp.name, a.max_model_len)
    a.vocab_size = cfg["vocab_size"]
    a.load_format = "dummy" if a.smoke else None
    configs = a.configs.split(",")
    result = {"meta": C.meta(argv), "settings": vars(a), "model": display, "runs": []}
    for r in range(a.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for name in order:
            t = time.perf_counter()
            res = CONFIGS[name](a, model, tmp.name, f"{name}_{r}.json")
            rec = {"round": r, "config": name, "wall_s": time.perf_counter() - t,
                   **{k: res.get(k) for k in KEYS}, "completed": res.get("completed")}
            result["runs"].append(rec)
            C.write_json(a.out, result)
            print(f"round {r} {name}: " + " ".join(f"{k}={rec[k]:.2f}" for k in KEYS
                                                     if rec.get(k) is not None), flush=True)
    rows, base = [], None
    for name in configs:
        runs = [x for x in result["runs"] if x["config"] == name]
        med = {k: statistics.median(x[k] for x in runs) for k in KEYS}
        result.setdefault("medians", {})[name] = med
        base = base or med
        rows.append([name, C.fmt(med["output_throughput"], 0), C.fmt(med["mean_itl_ms"], 2),
                     C.fmt(med["mean_itl_ms"] / base["mean_itl_ms"], 2),
                     C.fmt(med["mean_ttft_ms"], 1), C.fmt(med["p99_itl_ms"], 1)])
    C.write_json(a.out, result)
    print(C.table(["config", "out tok/s", "mean ITL ms", "ITL x first", "mean TTFT ms",
                   "p99 ITL ms"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
