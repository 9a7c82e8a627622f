"""benchmarks/save_overlap.py --smoke: every cap gets a row whose numbers are consistent (the
save moved the bytes it reports, the overlapped run is no shorter than its longer part), and
the JSON names the command."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_save_overlap_smoke(tmp_path):
    out = tmp_path / "save_overlap.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "save_overlap.py"),
                           "--smoke", "--caps", "none,1,5", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["meta"]["command"] and r["settings"]["device"] == "cpu"
    assert [x["max_programs"] for x in r["rows"]] == [None, 1, 5]
    nbytes = 2 * 97 * 3 * 128 * 2  # K + V of the smoke's 97 tokens x 3 heads x 128 dims, bf16
    for x in r["rows"]:
        assert x["save_ms"] > 0 and x["gemm_ms"] > 0
        assert abs(x["save_gb_s"] * x["save_ms"] * 1e6 - nbytes) < 1e-3 * nbytes
        assert x["both_ms"] > 0
    assert "slowdown" in proc.stdout and "both / max" in proc.stdout
