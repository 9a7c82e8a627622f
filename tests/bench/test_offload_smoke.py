"""benchmarks/offload.py --smoke runs end to end on the CPU (tiny model; every saving method in
prefill, offload decode at several device-cache sizes next to the resident-sparse and dense
engines) and writes a complete JSON, a plot and a table."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "offload.py")
PREFILL = ["chunked/nosave", "chunked/flash", "chunked/memcpy", "chunked/gpu-direct",
           "segmented/nosave", "segmented/flash"]


def _positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "offload.json") as f:
        return json.load(f), proc.stdout, out


def test_metadata(smoke):
    r, _, out = smoke
    assert r["benchmark"] == "offload" and r["complete"] is True
    assert r["errors"] == [], [e["error"] for e in r["errors"]]
    # the only runs left out are duplicates (a fraction floored to the same slot count)
    assert all(s["reason"].startswith("same device cache") for s in r["skipped"]), r["skipped"]
    assert "offload.py" in r["command"] and "--smoke" in r["command"]
    assert r["date_utc"] and r["hostname"] and "gpu_name" in r and "gpu" in r
    for lib in ("torch", "triton"):
        assert r["versions"][lib]
    s = r["settings"]
    assert s["smoke"] is True and s["device"] == "cpu" and s["sparse_algorithm"] == "arkvale"
    assert r["shape"]["page_bytes_all_layers"] > 0 and r["definitions"] and r["notes"]
    assert os.path.getsize(out / "offload.png") > 0 and r["plot"].endswith("offload.png")


def test_prefill_by_saving_method(smoke):
    r, _, _ = smoke
    runs = r["prefill"]["runs"]
    assert sorted(runs) == sorted(PREFILL)
    for key in PREFILL:
        rec = runs[key]
        mode, method = key.split("/")
        assert "error" not in rec, rec.get("error")
        args = rec["engine"]["engine_args"]
        assert args["sparse_algorithm"] == "arkvale"
        assert bool(args.get("kv_offload")) is (method != "nosave")
        if method != "nosave":
            assert args["d2h_method"] == method
            assert rec["host_tier"]["pinned_gib"] > 0
        assert (args.get("max_inject_tokens") is not None) is (mode == "segmented")
        assert rec["cut_by_time_budget"] is False
        assert _positive(rec["median_s"]) and rec["median_drained_s"] >= rec["median_s"]
        for rep in rec["reps"]:
            assert rep["prompt_len"] == r["settings"]["prefill_len"]
            assert rep["tokens_done"] == rep["prompt_len"] and rep["steps"] >= 1
            assert (rep["bytes_saved"] > 0) is (method != "nosave")
        if mode == "chunked":  # a prompt of two chunks
            assert all(rep["steps"] == 2 for rep in rec["reps"])
        if method != "nosave":
            assert _positive(rec["ratio_to_nosave"])
    assert isinstance(r["prefill"]["ratios"]["chunked/flash"]["meets_target"], bool)
    assert _positive(r["summary"]["prefill_chunked/flash_ratio"])


def test_decode_plans(smoke):
    r, _, _ = smoke
    configs = r["decode"]["configs"]
    assert [c["plan"]["batch"] for c in configs.values()] == [2, 4]
    for c in configs.values():
        p = c["plan"]
        assert p["full_slots_per_layer"] >= p["mandatory_slots_per_layer"] > 0
        assert p["prompt_len"] + p["decode_room_tokens"] == p["max_model_len"]
        assert set(c["runs"]) == {"resident-sparse", "dense", "offload-0.25", "offload-0.5",
                                  "offload-1.0", "offload-min"}


def test_decode_runs(smoke):
    r, _, _ = smoke
    steps = r["settings"]["decode_steps"]
    for key, c in r["decode"]["configs"].items():
        p, runs = c["plan"], c["runs"]
        for label, rec in runs.items():
            assert "error" not in rec, (key, label, rec.get("error"))
            if rec.get("same_as"):  # floored to the slots of a run already measured
                assert runs[rec["same_as"]]["slots_per_layer"] == rec["slots_per_layer"]
                continue
            assert rec["timed_steps"] == steps and rec["pure_decode_steps"] == steps
            assert rec["pure_decode_verified"] is True
            assert _positive(rec["ms_per_step"]) and _positive(rec["host_ms"]["median"])
            assert isinstance(rec["cuda_graphs_used"], bool)
            assert isinstance(rec["engine"]["enforce_eager"], bool)
            assert isinstance(rec["engine"]["cuda_graphs"], bool)
            assert _positive(rec["prefill"]["wall_s"])
            assert _positive(rec["ratio_to_resident_sparse"]) and _positive(rec["ratio_to_dense"])
            if rec["kind"] != "offload":
                assert rec["hit_rate"] is None and rec["pages_loaded_per_step"] == 0
                continue
            assert p["mandatory_slots_per_layer"] <= rec["slots_per_layer"] \
                <= p["full_slots_per_layer"]
            assert 0 < rec["cache_fraction"] <= 1
            assert 0 <= rec["hit_rate"] <= 1 and rec["pages_loaded_per_step"] >= 0
            # decode starts warm: the prefills left their pages in slots
            if rec["cache_fraction"] == 1:
                assert rec["first_step_pages_loaded"] == 0
            assert len(rec["per_step"]) == steps
            assert rec["engine"]["engine_args"]["kv_offload"] is True
        assert runs["offload-1.0"]["slots_per_layer"] == p["full_slots_per_layer"]
        # the smallest cache: what the batch selects plus one prompt being prefilled
        assert runs["offload-min"]["slots_per_layer"] == min(
            p["full_slots_per_layer"],
            p["mandatory_slots_per_layer"] + p["full_slots_per_layer"] // p["batch"])
        assert runs["dense"]["engine"]["engine_args"]["sparse_algorithm"] == "dense"


def test_table_printed_last(smoke):
    _, stdout, _ = smoke
    tail = stdout[stdout.rindex("wrote "):]
    assert "x nosave" in tail and "ms/step" in tail and "offload-1.0" in tail
