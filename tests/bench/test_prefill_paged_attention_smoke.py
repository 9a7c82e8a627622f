"""benchmarks/prefill_paged_attention.py --smoke: the kernel and the torch path it replaced agree
on the benchmark's own inputs, and the JSON holds every field the table reads."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_prefill_paged_attention_smoke(tmp_path):
    out = tmp_path / "pp.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                        "prefill_paged_attention.py"),
                           "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert case["prefix"] == 37 and case["chunk"] == 21
    assert case["best"] is not None and case["best"]["max_abs_diff"] < 1e-4
    assert "speed-up" in proc.stdout
