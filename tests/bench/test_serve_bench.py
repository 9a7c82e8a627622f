"""`sparseserve bench serve` against a live `sparseserve serve` (a subprocess on a free port,
the embedded SmolLM2-135M on CPU), and the in-process mode against it."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from sparseserve.bench.serve_metrics import METRICS  # noqa: E402

MAX_MODEL_LEN = 2048
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "sparseserve.cli", "serve", "--port", str(port),
                             "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                             "--uvicorn-log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    # while the server loads: fill the client's tokenizer cache (seconds for the GGUF one)
    from sparseserve.bench.serve_cli import client_tokenizer
    from sparseserve.model.loader.source import DEFAULT_MODEL_NAME
    client_tokenizer(None, DEFAULT_MODEL_NAME)
    deadline = time.time() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("server did not come up in 180 s")
        time.sleep(0.5)
    yield {"port": port, "base": base}
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench(args: list[str], tmp_path, name: str) -> tuple[int, dict]:
    from sparseserve.cli import main
    rc = main(["bench", "serve", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", name] + args)
    with open(tmp_path / name) as f:
        return rc, json.load(f)


def check_run(r: dict, n: int, output_lens: list[int]) -> None:
    """What every successful run must satisfy (`output_lens`: the requests' max_tokens)."""
    assert r["completed"] == n and r["failed"] == 0 and r["errors"] == [""] * n
    for m in METRICS:
        for stat in ("mean", "median", "std"):
            assert r[f"{stat}_{m}_ms"] is not None and r[f"{stat}_{m}_ms"] >= 0, (stat, m)
        for p in r["metric_percentiles"]:
            assert r[f"p{p:g}_{m}_ms"] is not None, (p, m)
    assert r["output_lens"] == output_lens  # ignore_eos: the whole max_tokens
    for ttft, e2el, itl, out in zip(r["ttfts"], r["e2els"], r["itls"], r["output_lens"]):
        assert 0 < ttft <= e2el
        assert 1 <= len(itl) <= out - 1 and ttft + sum(itl) <= e2el + 1e-6
    # token counts are the server's usage, and its own counters agree
    assert r["usage_sources"] == ["server"]
    sm = r["server_metrics"]
    assert sm["generation_tokens"] == r["total_output_tokens"] == sum(output_lens)
    assert sm["prompt_tokens"] == r["total_input_tokens"] == sum(r["input_lens"])
    assert sm["requests_length"] == n and sm["preemptions"] == 0
    assert r["request_throughput"] == pytest.approx(n / r["duration"])
    assert r["output_throughput"] == pytest.approx(sum(output_lens) / r["duration"])


def test_poisson_longbench_over_http(server, tmp_path):
    rc, r = bench(["--port", str(server["port"]), "--dataset-name", "longbench", "--num-prompts", "4",
                   "--max-input-len", "96", "--longbench-output-len", "6", "--request-rate", "8",
                   "--ignore-eos", "--goodput", "ttft:600000", "tpot:600000",
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"],
                  tmp_path, "poisson.json")
    assert rc == 0
    check_run(r, 4, [6] * 4)
    assert r["request_rate"] == 8.0 and r["backend"] == "http" and r["prompt_format"] == "text"
    assert all(80 <= n <= 96 for n in r["input_lens"])  # real text cut to the drawn length
    assert len(set(r["datasets"])) >= 2
    assert 0 < r["request_goodput"] <= r["request_throughput"]  # generous SLOs: all good
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])


def test_inf_rate_token_ids_python_api_round_trips(server, tmp_path):
    from sparseserve.bench.serve_client import HTTPBackend
    from sparseserve.bench.serve_datasets import build_requests
    from sparseserve.bench.serve_report import save_result
    from sparseserve.bench.serve_runner import run_benchmark

    reqs = build_requests("random", 4, seed=2, vocab_size=49152, random_input_len=48,
                          random_output_len=6, random_range_ratio=0.5)
    lens = [len(q.prompt_token_ids) for q in reqs]
    backend = HTTPBackend(server["base"], sampling={"temperature": 0.0, "ignore_eos": True})
    r = run_benchmark(reqs, backend, request_rate=math.inf, percentiles=(50, 99),
                      percentile_metrics=METRICS, goodput={"ttft": 0.001})
    assert r["request_rate"] == "inf"
    check_run(r, 4, [q.output_len for q in reqs])
    assert len({q.output_len for q in reqs}) > 1  # the range ratio varies them
    assert r["input_lens"] == lens  # token-id prompts are taken as they are
    assert r["request_goodput"] == 0.0 <= r["request_throughput"]  # a 1 us TTFT SLO: none good
    path = save_result(r, str(tmp_path), "inf.json")
    with open(path) as f:
        assert json.load(f) == r


def test_failed_requests_are_counted_not_dropped(server, tmp_path, capsys):
    rc, r = bench(["--port", str(server["port"]), "--num-prompts", "3", "--random-input-len", "16",
                   "--random-output-len", "4", "--top-p", "5", "--tokenizer", "none",
                   "--vocab-size", "49152"], tmp_path, "failed.json")
    assert rc == 1
    assert r["prompt_format"] == "token-ids"
    assert r["completed"] == 0 and r["failed"] == 3 and len(r["errors"]) == 3
    assert all("HTTP 400" in e and "top_p" in e for e in r["errors"])
    assert r["mean_ttft_ms"] is None and r["request_throughput"] == 0.0
    assert "3 request(s) failed" in capsys.readouterr().out


def test_bad_flags_give_clear_errors(server, capsys):
    from sparseserve.cli import main
    assert main(["bench", "serve", "--port", str(server["port"]), "--goodput", "foo"]) == 2
    assert "KEY:MILLISECONDS" in capsys.readouterr().err
    assert main(["bench", "serve", "--port", str(_free_port()), "--num-prompts", "1"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    assert main(["bench", "serve", "--port", str(server["port"]), "--model", "gpt-4o"]) == 2
    assert "not 'gpt-4o'" in capsys.readouterr().err


def test_in_process_agrees_with_http(server, tmp_path):
    common = ["--dataset-name", "longbench", "--num-prompts", "3", "--max-input-len", "64",
              "--longbench-output-len", "5", "--ignore-eos", "--seed", "11",
              "--max-concurrency", "1", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    rc_http, h = bench(["--port", str(server["port"])] + common, tmp_path, "http.json")
    rc_inp, p = bench(["--engine-args", f"--max-model-len {MAX_MODEL_LEN}"] + common, tmp_path, "inp.json")
    assert rc_http == rc_inp == 0 and p["backend"] == "in-process"
    check_run(h, 3, [5] * 3)
    check_run(p, 3, [5] * 3)
    assert p["input_lens"] == h["input_lens"] and p["output_lens"] == h["output_lens"]
    assert p["datasets"] == h["datasets"]
    # one request at a time, greedy, the same engine: the same tokens
    assert p["generated_texts"] == h["generated_texts"]
