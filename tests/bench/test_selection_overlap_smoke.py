"""benchmarks/selection_overlap.py: the overlap statistics against hand-made selections, and
the script end to end on a tiny model (--smoke)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from selection_overlap import margin_sweep, overlap_stats, window_sweep  # noqa: E402


def test_overlap_stats_by_hand():
    # one (row, layer, head): pages {0, 5, 6, 9} then {0, 5, 7, 9} then {0, 6, 8, 9};
    # sink 1 (page 0), local 1 (the highest page): chosen = the middle two
    seq = [frozenset({0, 5, 6, 9}), frozenset({0, 5, 7, 9}), frozenset({0, 6, 8, 9})]
    s = overlap_stats({(0, 0, 0): seq}, window=2, kept=(1, 1), min_pages=4)
    assert s["samples"] == 2
    assert s["overlap_all"] == pytest.approx((3 / 4 + 2 / 4) / 2)
    assert s["overlap_chosen"] == pytest.approx((1 / 2 + 0 / 2) / 2)
    # step 2 within the last two steps: 0, 6 (step 0), 9 -> 3 of 4; chosen 6 of {6, 8}
    assert s["window_all"] == pytest.approx((3 / 4 + 3 / 4) / 2)
    assert s["window_chosen"] == pytest.approx((1 / 2 + 1 / 2) / 2)
    assert s["per_layer_overlap_chosen"] == {0: pytest.approx(0.25)}
    # a selection smaller than the budget (everything selected) is skipped
    assert overlap_stats({(0, 0, 0): seq}, 2, (1, 1), min_pages=5)["samples"] == 0


def test_window_sweep_by_hand():
    seq = [frozenset({0, 5, 6, 9}), frozenset({0, 5, 7, 9}), frozenset({0, 6, 8, 9})]
    s = window_sweep({(0, 0, 0): seq}, [1, 2, 3], min_pages=4)
    # w = 1: step 1 finds 0, 5, 9 (union of 5 pages), step 2 finds 0, 9 (union of 6)
    assert s["1"] == {"samples": 2, "reuse": pytest.approx((3 / 4 + 2 / 4) / 2),
                      "working_set_x_selection": pytest.approx((5 / 4 + 6 / 4) / 2)}
    # w = 2: only step 2 has a full window: 0, 6, 9 of {0, 5, 6, 7, 9}; union of 6 pages
    assert s["2"] == {"samples": 1, "reuse": pytest.approx(3 / 4),
                      "working_set_x_selection": pytest.approx(6 / 4)}
    assert s["3"] == {"samples": 0, "reuse": None, "working_set_x_selection": None}


def test_margin_sweep_by_hand():
    seq = [frozenset({0, 5, 6, 9}), frozenset({0, 5, 7, 9}), frozenset({0, 6, 8, 9})]
    ahead = [(7, 3), (8, 6), (1, 2)]  # the best pages each step left out, best first
    s = margin_sweep({(0, 0, 0): seq}, {(0, 0, 0): ahead}, 1, [0, 1, 2], min_pages=4)
    # m = 0 is the window alone (w = 1): 3/4 then 2/4
    assert s["0"]["reuse"] == pytest.approx((3 / 4 + 2 / 4) / 2)
    # m = 1: step 1 also holds 7 (4/4, union of 5), step 2 also holds 8 (3/4, union of 6)
    assert s["1"] == {"samples": 2, "reuse": pytest.approx((4 / 4 + 3 / 4) / 2),
                      "working_set_x_selection": pytest.approx((5 / 4 + 6 / 4) / 2)}
    # m = 2: step 2 holds 8 and 6 as well: 4/4; unions {0,3,5,6,7,9} and {0,5,6,7,8,9}
    assert s["2"]["reuse"] == pytest.approx(1.0)
    assert s["2"]["working_set_x_selection"] == pytest.approx((6 / 4 + 6 / 4) / 2)


def test_smoke_run(tmp_path):
    out = tmp_path / "o.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "selection_overlap.py"),
                           "--smoke", "--windows", "1,2,4", "--window", "2", "--margins", "2",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"arkvale", "keycode2"}
    for run in r["runs"].values():
        assert run["samples"] > 0
        for k in ("overlap_all", "overlap_chosen", "window_all", "window_chosen"):
            assert 0.0 <= run[k] <= 1.0
        # what was selected in the last w steps includes what the last step selected
        assert run["window_all"] >= run["overlap_all"] - 1e-9
        assert run["window_chosen"] >= run["overlap_chosen"] - 1e-9
        # a longer window finds at least as much, and costs at least as many slots
        sw = [run["window_sweep"][w] for w in ("1", "2", "4")]
        assert all(x["samples"] > 0 for x in sw)
        assert sw[0]["reuse"] == pytest.approx(run["overlap_all"])  # the same steps
        assert all(1.0 <= x["working_set_x_selection"] for x in sw)
        assert sw[0]["working_set_x_selection"] <= sw[2]["working_set_x_selection"]
        # holding the next-best pages as well finds at least what the window alone finds
        ms = run["margin_sweep"]
        assert ms["2"]["reuse"] >= ms["0"]["reuse"] - 1e-9
        assert ms["0"]["reuse"] == pytest.approx(run["window_sweep"]["2"]["reuse"])
    assert "overlap % all" in proc.stdout and "lookahead sweep" in proc.stdout
