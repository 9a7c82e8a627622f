"""benchmarks/decode_launches.py and prefill_launches.py end to end on the CPU (the GPU code
paths forced, Triton interpreted): they count the kernel launches of one layer's attention
in a step, the instrument for what a CUDA-graph decode step and the eager part of a
piecewise-graph prefill step cost. Their counts are bounded by today's (a fusion that comes
undone fails here): offloaded decode 9 launches per layer (11 when a token fills its page),
a dense whole-prompt chunk 8 (11 after a prefix), an offloaded layer segment ~13 per step."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _count(script, *args, tmp_path):
    out = tmp_path / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args,
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("fills,most", [(False, 9), (True, 11)])
def test_decode_launches(tmp_path, fills, most):
    r = _count("decode_launches.py", *(["--fills"] if fills else []), tmp_path=tmp_path)
    assert r["decode_fills"] is fills
    later = [n for layer, n in r["per_layer"].items() if int(layer) >= 1]
    assert later and max(later) <= most
    ops = r["ops"]["1"]
    assert ops["triton._page_select_kernel"] == 1 and ops["triton._paged_decode_kernel"] == 1


def test_prefill_launches(tmp_path):
    dense = _count("prefill_launches.py", "--preset", "dense", tmp_path=tmp_path)
    assert set(dense["per_layer"]) == {"0", "1"} and dense["per_layer"]["1"] <= 8
    assert dense["ops"]["1"]["aten.scaled_dot_product_attention"] == 1
    cont = _count("prefill_launches.py", "--preset", "dense", "--continue", tmp_path=tmp_path)
    assert cont["per_layer"]["1"] <= 5  # one paged prefill launch over the prefix's pages
    off = _count("prefill_launches.py", "--preset", "sparseserve", tmp_path=tmp_path)
    ops = off["ops"]["1"]
    steps = ops["triton._store_rows_kernel"]  # one slot store per layer and step
    # 26 at layer 1 over its 2 steps today (one of them also makes the step's plans: one
    # host-to-device copy); 13 per layer and step
    assert steps >= 1 and off["per_layer"]["1"] <= 13 * steps
    assert ops["triton._page_summary_kernel"] == steps  # ArkVale's box: one launch
