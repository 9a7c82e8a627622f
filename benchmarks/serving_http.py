"""The serving comparison over HTTP, as a user runs it: for each preset a real
`sparseserve serve` process, then `sparseserve bench serve --base-url ...` against it
(streaming OpenAI completions, the server's /metrics read before and after), the server
stopped before the next preset starts. Prints a table with each preset's ratios to `dense`
at the same rate and writes one JSON (every bench result, the server commands).

  # one H200, LWM-7B shape, dummy weights, 20 GiB device KV (serving.md's setup, fewer requests)
  python benchmarks/serving_http.py --out $OUT/serving_http.json --model lwm-7b \\
      --presets sparseserve,dense --request-rate 2 --num-prompts 16
  # a preset with "+async" runs the server with --async-scheduling (e.g. dense+async), with
  # "+piecewise" with --cudagraph-mode FULL_AND_PIECEWISE (e.g. dense+async+piecewise),
  # "+full" with --cudagraph-mode FULL (the default where it captures something),
  # "+decode-only" with --cudagraph-mode FULL_DECODE_ONLY, "+thread" with --no-engine-process
  python benchmarks/serving_http.py --out /tmp/h.json --smoke      # tiny model on the CPU

Each server starts with an empty Triton cache (`--triton-cache fresh`, the default), as a
user's first server does, so no preset inherits kernels an earlier one compiled; the table's
"compiles" column is the server's Triton compilations during the measured pass (0 when the
start-up warm-up covered everything).

The in-process sweep (benchmarks/serving.py) measures the same quantities without HTTP; this
script is the check that the server path gives the same picture. Needs the server stack
(fastapi, uvicorn, httpx, prometheus-client).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402
import engine_bench as E  # noqa: E402

GiB = 1 << 30
KEYS = ("completed", "failed", "duration", "output_throughput", "mean_ttft_ms", "mean_itl_ms",
        "p99_itl_ms", "mean_e2el_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(a, model: str, preset: str, port: int) -> list[str]:
    """`preset` is a preset name with optional modifiers: "+async" (the server with
    --async-scheduling), "+piecewise" (--cudagraph-mode FULL_AND_PIECEWISE), "+full"
    (--cudagraph-mode FULL), "+decode-only" (--cudagraph-mode FULL_DECODE_ONLY: steps with
    prefill work eager, the default before FULL), "+thread" (--no-engine-process: the engine
    in a thread of the server instead of its own process)."""
    preset, *mods = preset.split("+")
    bad = set(mods) - {"async", "piecewise", "full", "decode-only", "thread"}
    if bad or len({"piecewise", "full", "decode-only"} & set(mods)) > 1:
        raise ValueError(f"unknown or conflicting preset modifier(s) {sorted(mods)} (known: "
                         "+async, +thread, one of +piecewise / +full / +decode-only)")
    cmd = [sys.executable, "-m", "sparseserve.cli", "serve", model, "--port", str(port),
           "--preset", preset, "--max-model-len", str(a.max_model_len),
           "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens),
           "--kv-cache-memory-bytes", str(int(a.kv_cache_gib * GiB)),
           "--uvicorn-log-level", "warning"]
    if a.load_format:
        cmd += ["--load-format", a.load_format]
    if preset != "dense":
        cmd += ["--token-budget", str(a.token_budget)]
    if preset in ("sparse-offload", "sparseserve"):
        cmd += ["--kv-offloading-size", str(a.host_gib)]
    if "async" in mods:
        cmd += ["--async-scheduling"]
    if "piecewise" in mods:
        cmd += ["--cudagraph-mode", "FULL_AND_PIECEWISE"]
    if "full" in mods:
        cmd += ["--cudagraph-mode", "FULL"]
    if "decode-only" in mods:
        cmd += ["--cudagraph-mode", "FULL_DECODE_ONLY"]
    if "thread" in mods:  # the engine stepped by a thread of the server process
        cmd += ["--no-engine-process"]
    if a.smoke:
        cmd += ["--device", "cpu", "--dtype", "float32"]
    return cmd


def wait_healthy(proc, base: str, timeout_s: float) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: "
                               f"{proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"server not healthy after {timeout_s:.0f} s")
        time.sleep(0.5)


def bench(base: str, a, num_prompts: int, rate: str, out_dir: str, name: str) -> dict:
    from sparseserve.cli import main

    # dummy weights have no tokenizer: prompts are random token ids of the model's vocabulary
    args = ["bench", "serve", "--base-url", base, "--dataset-name", a.dataset_name,
            "--tokenizer", "none", "--vocab-size", str(a.vocab_size),
            "--num-prompts", str(num_prompts), "--request-rate", rate, "--seed", str(a.seed),
            "--max-input-len", str(a.max_input_len), "--token-id-prompts", "--ignore-eos",
            "--disable-tqdm", "--save-result", "--result-dir", out_dir,
            "--result-filename", name]
    if a.dataset_name == "random":
        args += ["--random-input-len", str(a.random_input_len),
                 "--random-output-len", str(a.random_output_len)]
    rc = main(args)
    if rc != 0:
        raise RuntimeError(f"bench serve exited with {rc}")
    with open(os.path.join(out_dir, name)) as f:
        r = json.load(f)
    r["exit_code"] = rc
    return r


def run_preset(a, model: str, preset: str, out_dir: str) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = server_command(a, model, preset, port)
    rec: dict = {"server_command": " ".join(cmd)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    if a.triton_cache == "fresh":
        # an empty Triton cache per server, as a user's first server has: no preset inherits
        # the kernels an earlier one compiled (the twentieth session's first server paid
        # 1.38 s of mid-serving compiles that the later ones found on disk)
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton-{preset}-", dir=out_dir)
    rec["triton_cache"] = a.triton_cache
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        wait_healthy(proc, base, a.start_timeout_s)
        rec["start_s"] = time.perf_counter() - t
        # two short requests first: kernel compilation and allocator warm-up are not measured
        bench(base, a, 2, "inf", out_dir, f"{preset}_warmup.json")
        rec["result"] = bench(base, a, a.num_prompts, a.request_rate, out_dir, f"{preset}.json")
    except Exception as exc:  # noqa: BLE001 - recorded; the next preset still runs
        rec.update(C.error_record(exc))
    finally:
        rec["server_exit_code"] = stop_server(proc)
    return rec


def stop_server(proc) -> int:
    """SIGTERM (the server drains), SIGKILL after 60 s; its exit code."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--model", default="lwm-7b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--presets", default="sparseserve,dense")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--request-rate", default="2", help="req/s (Poisson) or inf")
    E.add_workload_args(p)  # the same workload and engine shape as serving.py
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=240)
    p.add_argument("--triton-cache", choices=("fresh", "shared"), default="fresh",
                   help="fresh (default): each server starts with an empty Triton cache, as a "
                        "user's first server; shared: the machine's, warmed by earlier runs")
    p.add_argument("--smoke", action="store_true", help="tiny dummy model on the CPU")
    a = p.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    model = a.model
    if a.smoke:
        a.model, a.dataset_name, a.num_prompts, a.request_rate = None, "random", 4, "inf"
        a.max_model_len, a.random_input_len, a.random_output_len = 512, 97, 8
        a.max_input_len, a.kv_cache_gib, a.host_gib, a.token_budget = 256, 0.01, 0.05, 128
    model, cfg, _ = C.resolve_model(a, tmp.name, a.max_model_len)
    a.vocab_size = cfg["vocab_size"]
    result = {"meta": C.meta(argv), "settings": vars(a), "presets": {}}
    for preset in a.presets.split(","):
        result["presets"][preset] = run_preset(a, model, preset, tmp.name)
        C.write_json(a.out, result)
    rows = []
    # the baseline: the first dense preset (dense, dense+async, ...)
    base = next((n for n in result["presets"] if n.split("+")[0] == "dense"), None)
    dense = (result["presets"].get(base) or {}).get("result")
    for preset, rec in result["presets"].items():
        r = rec.get("result")
        if r is None:
            rows.append([preset, "error: " + rec.get("error", "?")[:60]] + [""] * 7)
            continue
        x = (r["output_throughput"] / dense["output_throughput"]) if dense else None
        ttft_x = (dense["mean_ttft_ms"] / r["mean_ttft_ms"]) if dense else None
        rows.append([preset, f"{r['completed']}/{a.num_prompts}", C.fmt(r["output_throughput"], 1),
                     C.fmt(x, 2), C.fmt(r["mean_ttft_ms"] / 1e3, 2), C.fmt(ttft_x, 2),
                     C.fmt(r["mean_itl_ms"], 1), C.fmt(r["p99_itl_ms"], 0),
                     C.fmt((r.get("server_metrics") or {}).get("triton_compiles"), 0)])
    print(f"wrote {a.out}\n")
    print(C.table(["preset", "done", "out tok/s", f"x {base or 'dense'}", "mean TTFT s",
                   "TTFT x lower", "mean ITL ms", "p99 ITL ms", "compiles"], rows))
    return 0 if all("result" in r for r in result["presets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
