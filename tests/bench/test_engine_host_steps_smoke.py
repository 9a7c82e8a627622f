"""benchmarks/engine_host_steps.py end to end on this tree, tiny settings: every round and tree
is recorded, ms per step is positive, and the medians name the trees compared."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_engine_host_steps_smoke(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "engine_host_steps.py"),
                    "--out", str(out), "--trees", ROOT, "--batches", "2,3", "--output-len", "5",
                    "--rounds", "2", "--logprobs", "0"], check=True, cwd=ROOT, timeout=300)
    r = json.loads(out.read_text())
    assert [s["round"] for s in r["samples"]] == [0, 1]
    assert all(set(s["ms_per_step"]) == {"2", "3"} and min(s["ms_per_step"].values()) > 0
               for s in r["samples"])
    assert list(r["medians"]) == [ROOT]
