"""benchmarks/http_overhead.py end to end, tiny settings: the in-process run and a real
`sparseserve serve` (engine process) both complete every request, and the medians hold every
configuration's ITL."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_http_overhead_smoke(tmp_path):
    out = tmp_path / "ho.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "http_overhead.py"),
                    "--out", str(out), "--configs", "in-process,http", "--rounds", "1",
                    "--num-prompts", "3", "--input-len", "17", "--output-len", "5"],
                   check=True, cwd=ROOT, timeout=600, capture_output=True)
    r = json.loads(out.read_text())
    assert [x["config"] for x in r["runs"]] == ["in-process", "http"]
    assert all(x["completed"] == 3 and x["mean_itl_ms"] > 0 for x in r["runs"])
    assert set(r["medians"]) == {"in-process", "http"}
