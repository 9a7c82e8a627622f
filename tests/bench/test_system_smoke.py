"""benchmarks/system.py --smoke: the end-to-end benchmark runs the presets on a tiny model and
its records are consistent (every request completes, ratios are to dense of the same run)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("system") / "system.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "system.py"), "--smoke",
         "--out", str(out), "--configs", "dense,sparseserve", "--num-requests", "8"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_request_completes_and_counts_agree(result):
    r, _ = result
    assert r["errors"] == []
    n = len(r["trace"]["prompt_lens"])
    assert n == 8
    for name, rec in r["runs"].items():
        assert rec["completed"] == rec["num_requests"] == n, name
        assert rec["output_tokens"] == sum(r["trace"]["max_tokens"])
        assert rec["prompt_tokens"] == sum(r["trace"]["prompt_lens"])
        assert rec["ttft_s"]["max"] <= rec["wall_s"]
        assert rec["prefill_tokens_processed"] >= rec["prompt_tokens"]
        assert len(rec["steps"]) == rec["num_steps"]
    dense, full = r["runs"]["dense"], r["runs"]["sparseserve"]
    assert dense["vs_dense"]["wall"] == pytest.approx(1.0)
    assert full["vs_dense"]["wall"] == pytest.approx(full["wall_s"] / dense["wall_s"])
    assert full["num_preemptions"] == 0 and full["recomputed_tokens"] == 0
    assert dense["pages_loaded"] == 0 and full["engine_args"]["preset"] == "sparseserve"


def test_table_printed_last(result):
    _, stdout = result
    tail = stdout[stdout.rindex("wrote "):]
    assert "dense" in tail and "sparseserve" in tail and "x dense" in tail
