"""benchmarks/offline_throughput.py --smoke runs end to end on the CPU (tiny model, tiny
workloads, every path including the transformers comparison) and writes a complete JSON."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "offline_throughput.py")


def _positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@pytest.fixture(scope="module")
def smoke_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "offline_throughput.json") as f:
        return json.load(f), proc.stdout


def test_metadata(smoke_result):
    r, _ = smoke_result
    assert r["complete"] is True and r["errors"] == [] and r["skipped"] == []
    assert "offline_throughput.py" in r["command"] and "--smoke" in r["command"]
    assert r["date_utc"] and r["hostname"] and "gpu_name" in r and "gpu" in r
    for lib in ("torch", "triton", "transformers"):
        assert r["versions"][lib]
    assert r["settings"]["smoke"] is True and r["settings"]["device"] == "cpu"
    assert set(r["workloads"]) == {"a", "b"}


@pytest.mark.parametrize("name", ["a", "b"])
def test_throughput_and_hf_comparison(smoke_result, name):
    r, _ = smoke_result
    w, res = r["workloads"][name], r["results"][name]
    for eng in ("sparseserve", "hf"):
        e = res[eng]
        assert "error" not in e, e.get("error")
        for key in ("wall_s", "total_tokens_per_s", "output_tokens_per_s"):
            assert _positive(e[key]), (eng, key, e.get(key))
        assert e["prompt_tokens"] == w["num_requests"] * w["prompt_len"]
        assert e["output_tokens"] == w["num_requests"] * w["output_len"]
        assert e["all_full_length"] is True
    assert res["sparseserve"]["num_preemptions"] == 0
    assert res["hf"]["transformers"] == r["versions"]["transformers"]
    assert res["hf"]["settings"]["cache_implementation"] == "static"
    assert _positive(res["ratio_total_tokens_per_s"])
    assert _positive(res["ratio_output_tokens_per_s"])
    if name == "a":
        assert isinstance(res["meets_target"], bool)


@pytest.mark.parametrize("mode", ["default", "eager"])
def test_decode_steps(smoke_result, mode):
    r, _ = smoke_result
    rec = r["results"]["decode_steps"][mode]
    assert rec["engine"]["engine_args"]["enforce_eager"] is (mode == "eager")
    assert rec["engine"]["engine_args"].get("sparse_algorithm", "dense") == "dense"
    assert "cuda_graph_batch_sizes" in rec["engine"]
    batches = r["settings"]["decode"]["batches"]
    assert sorted(rec["batches"], key=int) == [str(b) for b in batches]
    for b in batches:
        d = rec["batches"][str(b)]
        assert d["timed_steps"] == r["settings"]["decode"]["steps"]
        assert d["pure_decode_steps"] == d["timed_steps"] and d["pure_decode_verified"]
        for key in ("step_ms", "host_ms", "execute_ms", "engine_overhead_ms"):
            assert _positive(d[key]["mean"]) and _positive(d[key]["median"]), key
        assert 0 < d["host_frac"] <= 1.5 and 0 < d["host_total_frac"] <= 1.5
        assert isinstance(d["meets_host_target"], bool)


def test_table_printed_last(smoke_result):
    _, stdout = smoke_result
    assert "ms/step" in stdout and "ss/hf" in stdout
