"""benchmarks/needles.py --quick: the needle phase alone on SmolLM2 (512 tokens): every setting
answers every question of the haystacks, a pass is the answer among the first output tokens,
and the table is printed."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_needles_quick(tmp_path):
    out = tmp_path / "n.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "needles.py"),
                           "--out", str(out), "--quick"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["needle"]["settings"]
    assert [r["key"] for r in rows] == ["dense", "keycode2/b256/s1/l2/d0"]
    questions = {(r["haystack"], r["depth"], r["answer"]) for r in rows[0]["results"]}
    assert len(questions) == 6  # 5 keys in the multi-key haystack + one single needle
    for row in rows:
        assert {(r["haystack"], r["depth"], r["answer"]) for r in row["results"]} == questions
        for r in row["results"]:
            assert r["passed"] == (r["answer"] in r["output"]), r
        assert row["pass_rate"] == sum(r["passed"] for r in row["results"]) / 6
    assert "misses where dense passes" in proc.stdout
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "needles.py"),
                          "--out", str(tmp_path / "x.json"), "--needle-settings", "keycode2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "cannot parse" in bad.stderr
