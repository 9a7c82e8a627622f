"""benchmarks/serving.py --smoke: each preset's engine through the benchmark loop at each rate;
every request completes, ratios are to dense at the same rate, goodput is one of the rates."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_serving_smoke(tmp_path):
    out = tmp_path / "serving.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serving.py"),
                           "--smoke", "--out", str(out), "--presets", "dense,sparseserve"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == []
    rates = r["settings"]["rates"]
    for name in ("dense", "sparseserve"):
        pts = r["presets"][name]["points"]
        assert [p["rate"] for p in pts] == rates
        for p in pts:
            assert p["completed"] == r["settings"]["num_prompts"] and p["failed"] == 0
            assert p["mean_ttft_ms"] <= p["mean_e2el_ms"]
        assert r["presets"][name]["goodput_rate"] in rates + [None]
    assert os.path.exists(r["figure"])
    tail = proc.stdout[proc.stdout.rindex("wrote "):]
    assert "x dense" in tail and "goodput" in tail
