"""benchmarks/cpu_threads.py --smoke: every (load, threads) cell is measured, the policy among
them, and the engine's policy is back on after a fixed-count measurement."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke(tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cpu_threads.py"),
                           "--smoke", "--out", str(out), "--threads", "1,policy"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    cells = {(s["loaded"], s["threads"]) for s in r["summary"]}
    assert cells == {(False, 1), (False, "policy"), (True, 1), (True, "policy")}
    assert all(s["prefill_tok_s"] > 0 for s in r["samples"])
    assert len(r["samples"]) == 4  # one round
    assert "prefill_tok_s" in proc.stdout.splitlines()[-6]  # the table is printed last
