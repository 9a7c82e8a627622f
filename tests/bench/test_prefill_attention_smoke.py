"""benchmarks/prefill_attention.py --smoke: every backend that takes the shape gives timings for
every length; the JSON lists one row per (length, backend)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_rows(tmp_path):
    out = tmp_path / "pa.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "prefill_attention.py"),
                           "--out", str(out), "--smoke"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["n"], r["backend"]) for r in rows} == {(n, b) for n in (17, 97)
                                                       for b in ("flash", "math")}
    for r in rows:
        assert "error" not in r, r
        assert r["first_call_host_ms"] > 0 and r["steady_host_ms"] > 0 and r["gpu_ms"] > 0
    assert proc.stdout.rstrip().splitlines()[-1].split()[0] == "97"
