"""benchmarks/transfer.py --smoke runs end to end (tiny sizes, wall-clock timing) and writes a
complete JSON, the plot and the table; per-page copies above --per-page-max are reported as
skipped, never silently dropped. On a GPU the same smoke runs the CUDA paths (pinned host tier,
one more load row: a bulk copy of the same bytes)."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import GPU

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "transfer.py")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("transfer_bench")
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--per-page-max", "8",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "transfer.json") as f:
        return json.load(f), proc.stdout, out


def test_rows_and_checks(smoke):
    r, _, _ = smoke
    assert r["device"] and r["date"] and r["meta"]["command"]
    assert r["bulk"]["h2d_gbps"] > 0 and r["bulk"]["d2h_gbps"] > 0
    methods = {(x["direction"], x["method"]) for x in r["rows"]}
    # the CPU smoke has no bulk-same-bytes row (no pinned memory to copy from)
    want = {("load", "flash-h2d"), ("load", "flash-h2d-seq"), ("load", "per-page-copy"),
            ("save", "gpu-direct"), ("save", "per-page-copy"), ("save", "flash-d2h-t2"),
            ("save", "flash-d2h-t2-chunked")}
    assert methods == want | ({("load", "bulk-same-bytes")} if GPU else set())
    assert r["timing"] == "wall"  # --smoke times by wall clock on either device
    for row in r["rows"]:
        if row["method"] == "per-page-copy" and row["pages"] > 8:
            assert row["status"] == "skipped" and "per-page-max" in row["reason"]
        else:
            assert row["status"] == "ok", row
            assert row["gbps"] > 0 and row["bytes"] == 2 * row["pages"] * row["page_bytes"]
    assert r["checks"] and all(c["exact"] for c in r["checks"]), r["checks"]
    assert len(r["skipped"]) == 4


def test_plot_and_table(smoke):
    _, stdout, out = smoke
    assert (out / "transfer.png").stat().st_size > 10_000
    tail = stdout.strip().splitlines()
    assert tail[-1].startswith("wrote ")
    assert any(line.startswith("load flash-h2d") for line in tail[-14:])
