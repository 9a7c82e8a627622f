"""benchmarks/sparse_decode.py --smoke runs end to end on the CPU (tiny shapes, the Triton
kernels in the interpreter) and writes a complete JSON + plot; the GPU-only fields (CUDA graph
timings) go through the same reporting code with fabricated values."""
import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "sparse_decode.py")


def _positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "sparse_decode.json") as f:
        return json.load(f), proc.stdout, out


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("sparse_decode_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_metadata(smoke):
    r, _, _ = smoke
    assert r["complete"] is True and r["errors"] == [] and r["skipped"] == []
    assert "sparse_decode.py" in r["command"] and "--smoke" in r["command"]
    assert r["date_utc"] and "gpu_name" in r and "gpu" in r
    assert r["versions"]["torch"] and r["versions"]["triton"]
    s = r["settings"]
    assert s["smoke"] is True and s["device"] == "cpu"
    assert set(s["algorithms"]) == {"arkvale", "quest"}
    assert _positive(r["copy"]["bw_tbs"]) and _positive(r["copy"]["us"])
    assert r["elapsed_s"] < 60


def test_rows(smoke):
    r, _, _ = smoke
    s = r["settings"]
    budget = s["token_budget"] // s["page_size"]
    got = {(x["context"], x["batch"], x["algorithm"]): x for x in r["rows"]}
    assert len(got) == len(r["rows"])
    for ctx in s["contexts"]:
        for b in s["batches"]:
            d = got[ctx, b, "dense"]
            for key in ("dense_us", "dense_latency_us", "bytes_read", "bw_tbs", "bw_frac_copy"):
                assert _positive(d[key]), key
            assert d["checks"]["ok"], d["checks"]
            n = d["pages_per_head"]
            assert d["bytes_read"] == b * s["num_kv_heads"] * ctx * s["head_dim"] * 2 * 4  # fp32
            for alg in s["algorithms"]:
                x = got[ctx, b, alg]
                for key in ("select_us", "attend_us", "sparse_us", "score_us", "topk_us",
                            "topk_unsorted_us", "select_plus_attend_us", "select_latency_us",
                            "attend_latency_us", "sparse_latency_us", "ratio", "ratio_latency",
                            "attend_bytes", "select_bytes", "attend_bw_tbs", "select_bw_tbs",
                            "score_bw_tbs", "attend_bw_frac_copy", "select_bw_frac_copy",
                            "select_share", "summary_bytes", "kv_pool_bytes"):
                    assert _positive(x[key]), (alg, key, x.get(key))
                assert x["select_plus_attend_us"] == pytest.approx(x["select_us"] + x["attend_us"])
                assert x["ratio"] == pytest.approx(x["select_plus_attend_us"] / d["dense_us"])
                k = min(budget, n)
                assert x["selected_pages"] == [k, k]
                assert x["attend_bytes"] == b * s["num_kv_heads"] * k * s["page_size"] \
                    * s["head_dim"] * 2 * 4
                assert x["summary_frac"] == pytest.approx(1 / s["page_size"], rel=0.1)
                assert x["checks"]["ok"], x["checks"]
                assert x["graph_us"] is None and "GPU" in x["graph_error"]
                assert set(x["meets"]) == {"ratio", "attend_bw", "summary"}
                assert x["meets"]["summary"] is True


def test_targets_analysis_plot_table(smoke):
    r, stdout, out = smoke
    t = r["targets"]
    assert t["context"] == max(r["settings"]["contexts"]) and isinstance(t["all_met"], bool)
    assert len(t["rows"]) == len(r["settings"]["batches"]) * len(r["settings"]["algorithms"])
    assert r["select_analysis"]["lines"]
    assert os.path.getsize(out / "sparse_decode.png") > 10_000
    assert r["plot"].endswith("sparse_decode.png")
    tail = [line for line in stdout.splitlines() if line.strip()]
    header = next(i for i, line in enumerate(tail) if "sparse/dense" in line)
    assert len(tail) - header - 2 == len(r["rows"]) - len(r["rows"]) // 3  # the table is last


def test_gpu_like_rows_report(smoke, script, tmp_path, capsys):
    """What only a GPU run produces (graph timings, 128k rows, select dominating) still goes
    through the analysis, the targets, the plot and the table."""
    r, _, _ = smoke
    rows = copy.deepcopy(r["rows"])
    for x in rows:
        x["context"] *= 256  # 512 -> 128k
        if x["algorithm"] != "dense":
            x.update(graph_us=x["select_plus_attend_us"] * 0.5, graph_latency_us=1.0,
                     ratio_graph=0.05, select_us=300.0, attend_us=100.0, score_us=150.0,
                     topk_us=130.0, select_glue_us=20.0, select_share=0.75,
                     select_plus_attend_us=400.0)
    a = script.analyse(rows)
    assert a["context"] == 131072 and len(a["lines"]) == len(rows) // 3
    assert any("topk" in line for line in a["suggestions"])
    assert any("select dominates" in line for line in a["suggestions"])
    assert script.targets(rows)["is_128k"] is True
    assert os.path.getsize(script.plot(rows, str(tmp_path / "p.png"), [1, 2, 4])) > 10_000

    import common as C  # benchmarks/ is on sys.path once the script is imported

    script.print_table(C, rows, {"bw_tbs": None})
    assert "128k" in capsys.readouterr().out


def test_cuda_branches_with_fake_cuda(script, monkeypatch):
    """The GPU-only Python paths (event timing with spin + L2 flush, graph capture and replay
    timing) run with torch.cuda's calls faked on the CPU, so a slip there fails here and not
    in the one-shot GPU run. Kernels: the torch references."""
    import contextlib
    import time

    import torch

    import common as C

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    class Stream:
        def wait_stream(self, other):
            pass

    calls = {"graph": 0, "replay": 0, "spin": 0}

    class Graph:
        def replay(self):
            calls["replay"] += 1

    def graph(g):
        calls["graph"] += 1
        return contextlib.nullcontext()

    for name, val in {"synchronize": lambda *a: None, "Event": Event, "Stream": Stream,
                      "current_stream": Stream, "stream": lambda s: contextlib.nullcontext(),
                      "CUDAGraph": Graph, "graph": graph,
                      "_sleep": lambda n: calls.__setitem__("spin", calls["spin"] + 1)}.items():
        monkeypatch.setattr(torch.cuda, name, val, raising=False)
    s = dict(script.SMOKE, algorithms=["arkvale", "quest"], flush_mib=1, spin_cycles=10,
             min_reps=2, max_reps=3, target_s=0.01)
    bench = script.Bench(torch, C, s, torch.device("cpu"))
    bench.cuda = True  # take the CUDA branches
    bench.spin = torch.cuda._sleep
    assert bench.flush is None  # flush buffers are only made for real CUDA devices
    bench.flush = torch.empty(1 << 20, dtype=torch.uint8)
    copy = script.measure_copy(torch, bench, dict(s, copy_mib=1), torch.device("cpu"))
    assert _positive(copy["bw_tbs"])
    pool = script.build_pool(torch, s, torch.device("cpu"), torch.float32, 512, 2, s["algorithms"])
    rows = script.measure_combo(torch, bench, s, pool, 512, 2, copy["bw_tbs"], "torch", True)
    assert [r["algorithm"] for r in rows] == ["dense", "arkvale", "quest"]
    assert calls["graph"] == 2 and calls["replay"] > 0 and calls["spin"] > 0
    for r in rows[1:]:
        assert r["graph_error"] is None and _positive(r["graph_us"])
        assert _positive(r["graph_latency_us"]) and _positive(r["ratio_graph"])
        assert r["checks"]["ok"] and 2 <= r["reps"]["select"] <= 3


def test_smoke_key_code_shortlist(tmp_path):
    """The key-code shortlist is selectable (--algorithms): at 16 pages keycode2-sl2 runs its
    two stages (S = 8) in the interpreter, selects what its spec selects and is charged the
    box of every page + box and codes of the 8 shortlisted pages."""
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path),
                           "--contexts", "512", "--batches", "1", "--no-graph",
                           "--algorithms", "keycode2,keycode2-sl2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "sparse_decode.json") as f:
        r = json.load(f)
    assert r["complete"] is True
    rows = {x["algorithm"]: x for x in r["rows"]}
    sl, s = rows["keycode2-sl2"], r["settings"]
    n, hkv, d = sl["pages_per_head"], s["num_kv_heads"], s["head_dim"]
    assert sl["shortlist_pages"] == 8 < n == 16
    assert sl["checks"]["ok"] and sl["checks"]["spec_set_mismatch_frac"] == 0.0
    assert sl["checks"]["fused_set_mismatch_frac"] == 0.0
    box, codes = 2 * d * 4, s["page_size"] * d * 2 // 8  # fp32 box rows, 2-bit codes
    assert sl["select_bytes"] == hkv * (n * box + 8 * (box + codes)) + hkv * n * 4
    assert rows["keycode2"]["select_bytes"] == hkv * n * (box + codes) + hkv * n * 4


def test_smoke_keycode_sparq(tmp_path):
    """keycode2-sparq is selectable: its channel choice + fused select run in the interpreter
    (the fused-path timing calls its own kernels), select what the generic path selects, and
    are charged the int8 mean and the chosen channels' records of every page (R = D = 16
    here) plus one page's records for the width sums, with the 32-byte sectors reported
    beside it. A variant (``@score_kernel=1``: the first version of its score phase) runs
    beside it on the same summaries and selects the same pages; ``@records=0`` (the first
    layout: box and codes in separate rows, a width-sum row) on summaries of its own."""
    from sparseserve.kernels.sparq_records import record_words

    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path),
                           "--contexts", "512", "--batches", "1", "--no-graph",
                           "--algorithms", "keycode2-sparq,keycode2-sparq@score_kernel=1,"
                           "keycode2-sparq@records=0"],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "sparse_decode.json") as f:
        r = json.load(f)
    assert r["complete"] is True
    x, s = {x["algorithm"]: x for x in r["rows"]}["keycode2-sparq"], r["settings"]
    n, hkv, d = x["pages_per_head"], s["num_kv_heads"], s["head_dim"]
    ck = x["checks"]
    assert ck["ok"] and ck["fused_set_mismatch_frac"] == 0.0
    assert ck["select_set_mismatch_frac"] == 0.0
    rec = 4 * record_words(4, s["page_size"])  # fp32 box, 2-bit codes, width word, padding
    assert x["select_bytes"] == hkv * (n * (d + 4 + d * rec) + d * rec) + hkv * n * 4
    assert x["select_sector_bytes"] >= x["select_bytes"] and _positive(x["fused_us"])
    v = {x["algorithm"]: x for x in r["rows"]}["keycode2-sparq@score_kernel=1"]
    assert v["checks"]["ok"] and v["checks"]["fused_set_mismatch_frac"] == 0.0
    assert v["select_bytes"] == x["select_bytes"] and _positive(v["fused_us"])
    f = {x["algorithm"]: x for x in r["rows"]}["keycode2-sparq@records=0"]
    assert f["checks"]["ok"] and f["checks"]["fused_set_mismatch_frac"] == 0.0
    per_page = d + 4 + d * (2 * 4 + s["page_size"] // 4)  # fp32 box entries, 2-bit codes
    assert f["select_bytes"] == hkv * (n * per_page + d * 4) + hkv * n * 4
