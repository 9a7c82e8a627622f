"""benchmarks/graph_state.py (graph_check.py's state comparison) on a real two-tier cache: a
snapshot restores every tensor a retrieve writes (a rerun from it leaves the same state bit for
bit), a planted change in the bookkeeping or the device KV is reported where it is, a residency
index that lost an entry is reported, and out-of-range ids are flagged; plus the script's CPU
smoke (no graphs there: it runs the trace and says there was nothing to check)."""
import json
import os
import subprocess
import sys

import torch

from tests.kernels.test_retrieve import make_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import graph_state as G  # noqa: E402


class _Runner:
    """What tracked_state reads of a ModelRunner: its two-tier cache and sparse runtime."""

    def __init__(self, offload):
        self.offload, self.sparse = offload, None


def test_rerun_from_a_snapshot_is_identical_and_changes_are_located():
    c, pages, num_sel, rows = make_cache("category-lru", seed=3)
    state = G.tracked_state(_Runner(c))
    assert {"page_of", "last_access", "owner", "res_table", "res_fill", "dev_k.0",
            "dev_v.0", "step", "hit_miss"} <= set(state)
    assert not any(name.startswith("_") for name in state)  # no host tier
    before = G.snapshot(state)
    c.retrieve(0, pages, num_sel, rows)
    first = G.snapshot(state)
    assert G.diff_states(before, first)  # the retrieve changed something
    G.restore(state, before)
    c.retrieve(0, pages, num_sel, rows)
    second = G.snapshot(state)
    assert G.diff_states(first, second) == {}

    planted = G.snapshot(state)
    planted["page_of"][0, 7] += 1
    planted["dev_k.0"][5, 1, 2] = 123.0
    d = G.diff_states(second, planted)
    assert d["page_of"]["count"] == 1 and d["page_of"]["first"][0]["index"] == [0, 7]
    assert d["dev_k.0"]["first"][0]["index"] == [5, 1, 2] and d["dev_k.0"]["count"] == 1


def test_a_residency_index_that_lost_an_entry_is_reported():
    c, *_ = make_cache("lru", seed=5)
    state = G.tracked_state(_Runner(c))
    good = G.snapshot(state)
    broken = G.snapshot(state)
    slot = int(torch.nonzero(broken["page_of"][0] >= 0)[0])
    broken["res_table"][0][broken["res_table"][0] == slot] = -1
    d = G.diff_states(good, broken)
    assert "res_table.b" in d and "res_table.a" not in d


def test_out_of_range_ids_are_flagged():
    c, *_ = make_cache("lru", seed=7)
    state = G.tracked_state(_Runner(c))
    bounds = (c.num_slots, c.num_host_pages, c.num_rows)
    assert G.range_errors(state, *bounds) == []
    c.owner[0, 3] = c.num_rows + 5
    c.res_table[0, 0] = c.num_slots + 2
    errs = G.range_errors(state, *bounds)
    assert any("owner" in e for e in errs) and any("res_table" in e for e in errs)


def test_graph_check_smoke_runs_the_trace_on_cpu(tmp_path):
    out = tmp_path / "g.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "graph_check.py"), "--smoke",
         "--out", str(out), "--run-budget-s", "15", "--time-budget-s", "200"],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["run"]
    assert r["cuda_graphs"] is None and r["checked_steps"] == 0
    assert r["engine_steps"] > 0 and r["differing_steps"] == []
    assert "nothing to check" in proc.stdout + proc.stderr
