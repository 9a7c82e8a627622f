"""benchmarks/serving.py: the --smoke sweep end to end (each preset's engine through the
benchmark loop at each rate; ratios to dense at the same rate), a point cut at its time cap,
the report's ratio rules, and the documented GPU command (LWM-7B shape, 20 GiB device KV)."""
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
pytest.importorskip("prometheus_client")

import serving as S  # noqa: E402
import serving_report as R  # noqa: E402


def test_serving_smoke(tmp_path):
    out = tmp_path / "serving.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serving.py"),
                           "--smoke", "--out", str(out), "--presets", "sparseserve,dense"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == [] and r["complete"]
    rates = r["settings"]["rates"]
    assert rates == [2.0, "inf"]
    for name in ("dense", "sparseserve"):
        pts = r["presets"][name]["points"]
        assert [p["rate"] for p in pts] == rates
        for p in pts:
            assert p["completed"] == r["settings"]["num_prompts"] and p["failed"] == 0
            assert not p["truncated"] and p["mean_ttft_ms"] <= p["mean_e2el_ms"]
            # every request completed: the engine's token count is vLLM's output throughput
            assert p["out_tok_s"] == pytest.approx(p["output_throughput"])
        assert r["presets"][name]["goodput_rate"] in rates + [None]
        # the server counters are each point's own (the engine ran the warm-up and the
        # earlier points before): the same requests at each rate save the same KV bytes
        sm = [p["server_metrics"] for p in pts]
        assert sm[0]["prompt_tokens"] == sm[1]["prompt_tokens"] > 0
        if name == "sparseserve":
            assert sm[0]["bytes_saved"] == sm[1]["bytes_saved"] > 0
        for p, m in zip(pts, sm):
            # the step breakdown: every step is counted once, every prompt token prefilled
            # once (no preemption here), the time inside execute fits in the point's duration
            st = p["steps"]
            d, w = st["decode_only"], st["with_prefill"]
            assert d["steps"] + w["steps"] == st["steps"] > 0 and w["steps"] > 0
            assert w["prefill_tokens"] == pytest.approx(m["prompt_tokens"])
            # ... so the prompts were prefilled once, and the useful rate is the whole rate
            assert p["prefill_run_x"] == pytest.approx(1.0)
            assert p["useful_prefill_tok_s"] == pytest.approx(w["prefill_tokens_per_s"])
            assert 0 < st["exec_s"] <= p["duration"] + 1e-6
            assert st["outside_exec_s"] == pytest.approx(p["duration"] - st["exec_s"])
            assert d["pages_loaded_per_step"] >= 0 and w["pages_loaded_per_step"] >= 0
    c = r["comparison"]["sparseserve"]
    assert [x["rate"] for x in c["per_rate"]] == rates
    assert all(x["ttft_ratio_quality"] == "exact" for x in c["per_rate"])
    assert c["saturation_throughput_x"] > 0 and c["throughput_target_met"] in (True, False)
    assert os.path.exists(r["figure"])
    tail = proc.stdout[proc.stdout.rindex("wrote "):]
    assert "x dense" in tail and "goodput" in tail and "sparseserve vs dense" in tail
    assert tail.index("\ndense ") < tail.index("\nsparseserve ")  # dense first in the table


def test_point_cut_at_cap_leaves_engine_clean():
    from sparseserve.bench.serve_datasets import build_requests
    from sparseserve.engine.args import EngineArgs
    from sparseserve.engine.llm_engine import LLMEngine

    import common as C

    a = S.parse_args(["--smoke", "--out", "unused.json"])
    with tempfile.TemporaryDirectory() as tmp:
        model, cfg, _ = C.resolve_model(a, tmp, a.max_model_len)
        engine = LLMEngine(EngineArgs(model=model, **S.engine_args(a, "dense", "cpu", "float32")))
        vocab = cfg["vocab_size"]
        long = build_requests("random", 4, 0, vocab_size=vocab, random_input_len=64,
                              random_output_len=900, max_model_len=a.max_model_len)
        p = S.run_point(engine, long, math.inf, 0.5, 0)
        assert p["truncated"] and p["completed"] < 4 and p["failed"] == 4 - p["completed"]
        assert p["duration"] < 5 and not engine.has_unfinished_requests()
        assert p["out_tok_s"] > 0 and p["mean_ttft_lb_ms"] is not None
        # the engine serves the next point normally
        short = build_requests("random", 3, 1, vocab_size=vocab, random_input_len=32,
                               random_output_len=4, max_model_len=a.max_model_len)
        q = S.run_point(engine, short, 50.0, 60, 0, profile_steps=(0, 2))
        assert q["completed"] == 3 and not q["truncated"] and q["not_sent_after_cap"] == 0
        # the chosen steps ran under the profiler: their summaries, and only theirs
        assert [x["step"] for x in q["profiles"]] == [0, 2]
        assert all(x["profile"]["wall_ms"] > 0 and x["profile"]["top_cpu"] for x in q["profiles"])
        # requests that would arrive after the cap are not sent, and the point is marked
        many = build_requests("random", 10, 2, vocab_size=vocab, random_input_len=16,
                              random_output_len=2, max_model_len=a.max_model_len)
        q = S.run_point(engine, many, 4.0, 1.0, 0)
        assert q["not_sent_after_cap"] > 0 and q["num_prompts"] == 10 - q["not_sent_after_cap"]
        assert q["truncated"]


def test_ratio_rules():
    def pt(rate, tok, ttft, truncated=False):
        return {"rate": rate, "completed": 5, "num_prompts": 5, "out_tok_s": tok,
                "mean_ttft_ms": ttft, "mean_ttft_lb_ms": ttft, "truncated": truncated,
                "p99_itl_ms": 10.0, "mean_queue_s": 0.1}
    result = {"presets": {
        "dense": {"points": [pt(1.0, 100, 1000), pt("inf", 120, 9000, truncated=True)]},
        "sparseserve": {"points": [pt(1.0, 200, 100), pt("inf", 400, 1000)]}}, "errors": []}
    c = R.compare(result)["sparseserve"]
    assert c["saturation_throughput_x"] == pytest.approx(400 / 120)
    assert c["throughput_target_met"] is True
    assert c["ttft_x_lower_best"] == pytest.approx(10.0) and c["ttft_x_lower_best_rate"] == 1.0
    assert c["ttft_x_lower_best_quality"] == "exact" and c["ttft_target_met"] is True
    assert c["per_rate"][1]["ttft_ratio_quality"] == "lower bound"
    assert R.goodput(result["presets"]["dense"]["points"], 20.0, 2.0) == 1.0  # cut point: no
    assert R.goodput(result["presets"]["sparseserve"]["points"], 20.0, 2.0) == "inf"
    assert R.goodput(result["presets"]["sparseserve"]["points"], 5.0, 2.0) is None
    result["comparison"] = R.compare(result)
    assert "sparseserve vs dense" in R.table(result)
    assert result["comparison"]["sparseserve"]["goodput_x"] is None  # no goodput rates yet
    result["presets"]["dense"]["goodput_rate"] = 0.5
    result["presets"]["sparseserve"]["goodput_rate"] = 1.5
    assert R.compare(result)["sparseserve"]["goodput_x"] == pytest.approx(3.0)
    # each ladder has a probed point above its goodput (dense 1.0 and inf, sparseserve inf),
    # and those points missed: both goodputs are bracketed, the ratio is exact
    assert R.compare(result)["sparseserve"]["goodput_quality"] == "exact"
    # sparseserve meets the SLOs at the top of its ladder: its goodput is a floor
    result["presets"]["sparseserve"]["points"] = [pt(1.0, 1, 1), pt(2.0, 1, 1)]
    result["presets"]["sparseserve"]["goodput_rate"] = 2.0
    assert R.compare(result)["sparseserve"]["goodput_quality"] == "lower bound"
    # ... and so does dense: neither goodput is known, the ratio says nothing
    result["presets"]["dense"]["points"] = [pt(0.5, 1, 1), pt(1.0, 1, 1)]
    result["presets"]["dense"]["goodput_rate"] = 1.0
    assert R.compare(result)["sparseserve"]["goodput_quality"] == "undetermined"
    assert "goodput 2.00x (undetermined)" in R.table({**result, "comparison": R.compare(result)})
    # only dense's is a floor: the ratio can only be lower than shown
    result["presets"]["sparseserve"]["points"] = [pt(1.0, 1, 1), pt(2.0, 1, 1), pt(3.0, 1, 1)]
    assert R.compare(result)["sparseserve"]["goodput_quality"] == "upper bound"
    result["presets"]["sparseserve"]["goodput_rate"] = "inf"  # no finite ratio
    assert R.compare(result)["sparseserve"]["goodput_x"] is None


def test_goodput_ratio_range_follows_the_rungs():
    """The twentieth session's Llama-3-8B ladders (dense 0.5, 2, 3, 4.5; sparseserve 3, 4.5,
    6.75): goodputs 3.0 and 4.5 give 1.5x, somewhere in (4.5 / 4.5, 6.75 / 3.0); a ladder that
    stopped while meeting the SLOs leaves that end open."""
    pts = lambda *rates: [{"rate": r, "completed": 32} for r in rates]  # noqa: E731
    dense, mine = pts(0.5, 2.0, 3.0, 4.5), pts(3.0, 4.5, 6.75)
    assert R.goodput_ratio_range(mine, 4.5, dense, 3.0) == [pytest.approx(1.0),
                                                          pytest.approx(2.25)]
    assert R.goodput_ratio_range(pts(3.0, 4.5), 4.5, dense, 3.0) == [pytest.approx(1.0), None]
    assert R.goodput_ratio_range(mine, 4.5, pts(0.5, 3.0), 3.0) == [None, pytest.approx(2.25)]
    assert R.goodput_ratio_range(mine, None, dense, 3.0) is None
    assert R._range([1.0, 2.25]) == "; between the rungs: (1.00, 2.25)"
    assert R._range([1.0, None]) == "; between the rungs: (1.00, unbounded)"
    assert R._range([None, 2.0]) == "; between the rungs: (0, 2.00)"
    assert R._range([None, None]) == "" and R._range(None) == ""


def test_goodput_interpolated_between_the_rungs():
    """The twenty-first session's H100 ladders: dense meets the queue SLO at 3.75 (1.49 s) and
    misses it at 4.688 (2.34 s), so its queue reaches 2 s at 3.75 + 0.51 / 0.85 x 0.938; an SLO
    the next rung meets does not bound it; a metric missed already at the goodput, a floor,
    or a missing metric give no estimate; the ratio goes into compare() and the summary."""
    def pt(rate, queue, p99=195.0):
        return {"rate": rate, "completed": 32, "num_prompts": 32, "mean_queue_s": queue,
                "p99_itl_ms": p99}
    dense = [pt(2.0, 0.30), pt(3.0, 0.74), pt(3.75, 1.49), pt(4.688, 2.34)]
    want = 3.75 + (2.0 - 1.49) / (2.34 - 1.49) * (4.688 - 3.75)
    assert R.goodput_interpolated(dense, 3.75, 327.5, 2.0) == pytest.approx(want)
    # both SLOs missed at the next rung: the lower crossing (TBT at 3.75 + 0.25 x 0.938)
    both = dense[:3] + [pt(4.688, 2.34, p99=427.5)]
    tbt = 3.75 + (327.5 - 195.0) / (427.5 - 195.0) * (4.688 - 3.75)
    assert R.goodput_interpolated(both, 3.75, 327.5, 2.0) == pytest.approx(min(want, tbt))
    assert R.goodput_interpolated(dense[:3], 3.75, 327.5, 2.0) is None  # a floor
    assert R.goodput_interpolated(dense, None, 327.5, 2.0) is None
    gap = dense[:3] + [{"rate": 4.688, "completed": 32, "num_prompts": 32, "p99_itl_ms": 400.0}]
    assert R.goodput_interpolated(gap[:2] + [dict(gap[2], p99_itl_ms=None)] + gap[3:], 3.75,
                                  327.5, 2.0) is None
    mine = [pt(3.0, 0.47), pt(4.5, 0.97), pt(5.625, 1.70), pt(7.031, 2.70)]
    result = {"settings": {"tbt_slo_ms_used": 327.5, "queue_slo_s": 2.0},
              "presets": {"dense": {"points": dense, "goodput_rate": 3.75},
                          "sparseserve": {"points": mine, "goodput_rate": 5.625}}}
    mine_x = 5.625 + 0.3 / 1.0 * (7.031 - 5.625)
    c = R.compare(result)["sparseserve"]
    assert c["goodput_x_interpolated"] == pytest.approx(mine_x / want)  # ~1.40
    assert f"~{mine_x / want:.2f}x interpolating" in R.table({**result, "comparison": {
        "sparseserve": c}})


def test_rates_of_each_configuration(tmp_path):
    """--rates-of gives one configuration its own rates (a goodput sweep probes dense below
    its saturation); a name not run, or a rate <= 0, is an error that says what to pass."""
    a = S.parse_args(["--smoke", "--out", "x.json", "--presets", "sparseserve,dense",
                      "--rates-of", "dense=0.25,0.5"])
    assert a.rates_of == {"dense": [0.25, 0.5]} and a.rates == [2.0, math.inf]
    for bad in ("sparse=1", "dense", "dense=0,1"):
        with pytest.raises(SystemExit, match="--rates"):
            S.parse_args(["--smoke", "--out", "x.json", "--presets", "sparseserve,dense",
                          "--rates-of", bad])
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serving.py"),
                           "--smoke", "--out", str(out), "--presets", "sparseserve,dense",
                           "--rates", "inf", "--rates-of", "dense=7,13",
                           "--batched-tokens-of", "sparseserve=192"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [p["rate"] for p in r["presets"]["dense"]["points"]] == [7.0, 13.0]
    assert [p["rate"] for p in r["presets"]["sparseserve"]["points"]] == ["inf"]
    assert r["settings"]["rates_of"] == {"dense": [7.0, 13.0]}
    # --batched-tokens-of: that configuration's engine alone gets the step budget
    assert r["presets"]["sparseserve"]["engine_args"]["max_num_batched_tokens"] == 192
    assert r["presets"]["dense"]["engine_args"]["max_num_batched_tokens"] == 128


def test_async_scheduling_reaches_every_configuration():
    """--async-scheduling is an engine argument of every configuration (both sides of a
    comparison), and absent without the flag (the engine's default, synchronous)."""
    for flag, want in (([], None), (["--async-scheduling"], True)):
        a = S.parse_args(["--out", "x.json", "--presets", "dense,sparseserve", *flag])
        for name in ("dense", "sparseserve"):
            assert S.engine_args(a, name, "cpu", "float32").get("async_scheduling") is want


def test_batched_tokens_of_each_configuration():
    """--batched-tokens-of NAME=N sets one configuration's --max-num-batched-tokens; the others
    keep the common one; a name not run is an error that says what to pass."""
    a = S.parse_args(["--out", "x.json", "--presets", "dense,sparseserve",
                      "--max-num-batched-tokens", "2048",
                      "--batched-tokens-of", "sparseserve=4096"])
    assert a.batched_tokens_of == {"sparseserve": 4096}
    assert S.engine_args(a, "sparseserve", "cpu", "float32")["max_num_batched_tokens"] == 4096
    assert S.engine_args(a, "dense", "cpu", "float32")["max_num_batched_tokens"] == 2048
    for bad in ("sparse=4096", "sparseserve", "sparseserve=0", "sparseserve=4k"):
        with pytest.raises(SystemExit, match="--batched-tokens-of"):
            S.parse_args(["--out", "x.json", "--presets", "dense,sparseserve",
                          "--batched-tokens-of", bad])


def test_extend_ladder_probes_until_a_rate_misses(tmp_path):
    """--extend-ladder: a preset that meets both SLOs at its highest listed rate goes on at
    FACTOR x that rate (at most EXTRA_RUNGS more), so its goodput gets bracketed; a miss, `inf`
    or an unknown SLO stops it; the SLO must be known before the ladders run."""
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serving.py"),
                           "--smoke", "--out", str(out), "--presets", "dense", "--rates", "2",
                           "--extend-ladder", "4", "--tbt-slo-ms", "1e6", "--queue-slo-s", "1e6"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pts = json.loads(out.read_text())["presets"]["dense"]["points"]
    # every point meets SLOs this loose: the ladder grows by the most rungs allowed
    assert [p["rate"] for p in pts] == [2.0 * 4 ** i for i in range(1 + S.EXTRA_RUNGS)]
    assert all(p["completed"] == 6 for p in pts)
    met = {"rate": 2.0, "completed": 6, "p99_itl_ms": 10.0, "mean_queue_s": 0.5}
    assert R.next_rung(met, 20.0, 2.0, 1.5) == 3.0
    assert R.next_rung(met, 5.0, 2.0, 1.5) is None  # missed the TBT SLO: bracketed
    assert R.next_rung({**met, "mean_queue_s": 3.0}, 20.0, 2.0, 1.5) is None  # queueing
    assert R.next_rung({**met, "truncated": True}, 20.0, 2.0, 1.5) is None  # cut: a miss
    assert R.next_rung({**met, "rate": "inf"}, 20.0, 2.0, 1.5) is None
    assert R.next_rung(met, None, 2.0, 1.5) is None  # no SLO yet
    assert R.tbt_slo_ms({"presets": {"dense": {"points": [{"mean_itl_ms": 4.0}]}}}) == 100.0
    assert R.tbt_slo_ms({"presets": {}}, 7.0) == 7.0 and R.tbt_slo_ms({"presets": {}}) is None
    for bad, msg in ((["--presets", "dense", "--extend-ladder", "1"], "must be > 1"),
                     (["--presets", "sparseserve,dense", "--extend-ladder", "2"], "dense first")):
        with pytest.raises(SystemExit, match=msg):
            S.parse_args(["--smoke", "--out", "x.json", *bad])
    assert S.parse_args(["--smoke", "--out", "x.json", "--presets", "sparseserve,dense",
                         "--extend-ladder", "2", "--tbt-slo-ms", "300"]).extend_ladder == 2.0


def _documented_gpu_command() -> list[str]:
    with open(os.path.join(ROOT, "docs", "results", "serving.md")) as f:
        line = next(ln for ln in f if ln.startswith("source benchmarks/gpu_setup.sh;"))
    assert len(line) < 2000
    cmd = line.split("python3 benchmarks/serving.py", 1)[1].split("2>&1")[0]
    return shlex.split(cmd.replace("$OUT", "/tmp/out"))


def test_documented_gpu_command_is_the_lwm7b_setup():
    """The command of docs/results/serving.md parses and resolves (on the CPU, no weights)
    to the issue's setup: LWM-7B shape, 20 GiB device KV, both presets, LongBench lengths."""
    from sparseserve.engine.args import EngineArgs

    a = S.parse_args(_documented_gpu_command())
    assert a.names == ["sparseserve", "dense"] and a.dataset_name == "longbench"
    assert a.rates[-1] == math.inf and a.time_budget_s <= 500
    for preset in a.names:
        kw = S.engine_args(a, preset, "cpu", "bfloat16")  # device only decides the checks
        assert kw["kv_cache_memory_bytes"] == 21474836480 and kw["load_format"] == "dummy"
        cfg, _ = EngineArgs(model=a.model, **kw).create_engine_config()
        m = cfg.model
        assert (m.name, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
                m.head_dim, m.hidden_size) == ("lwm-7b", 32, 32, 32, 128, 4096)
        assert cfg.cache.num_pages == 40960  # slots per layer: 40,960 tokens of dense KV
        assert cfg.cache.kv_offload == (preset == "sparseserve")
        if preset == "sparseserve":
            assert cfg.scheduler.working_set_control and cfg.scheduler.max_inject_tokens
            assert cfg.cache.num_host_pages * cfg.cache.page_size >= 128 * 1024  # tokens


def test_ladder_rungs_run(tmp_path):
    """Figure 13's intermediate rungs: each builds with its overrides over sparse-offload and
    completes every request; --working-set-window reaches only the rungs with batch control."""
    out = tmp_path / "ladder.json"
    names = ["sparse-offload+ft", "sparse-offload+ft+wc", "sparse-offload+ft+wc+lp"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serving.py"),
                           "--smoke", "--out", str(out), "--rates", "inf",
                           "--working-set-window", "5", "--presets", ",".join(names)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == [] and list(r["presets"]) == names
    for name in names:
        kw = r["presets"][name]["engine_args"]
        assert kw["preset"] == "sparse-offload"
        assert (kw["h2d_method"], kw["d2h_method"]) == ("flash", "gpu-direct")
        assert kw.get("working_set_control") is (True if "+wc" in name else None)
        assert kw.get("layer_segmented_prefill") is (True if "+lp" in name else None)
        assert kw.get("working_set_window") == (5 if "+wc" in name else None)
        (p,) = r["presets"][name]["points"]
        assert p["completed"] == r["settings"]["num_prompts"] and not p["truncated"]
    assert os.path.exists(r["ladder_figure"])  # Figures 13, 15, 16a over the rungs


def test_ladder_figure_merges_runs(tmp_path):
    """A ladder split over device commands: serving_report.py merges the files' presets (a
    preset in two files from the later one), prints one table and draws the ladder; files
    with fewer than two rungs are an error that says which rungs it needs."""
    def pt(rate, done=5):
        return {"rate": rate, "completed": done, "num_prompts": 5, "out_tok_s": 10.0 * rate,
                "mean_ttft_ms": 100.0, "truncated": done < 5, "p99_itl_ms": 10.0,
                "mean_itl_ms": 5.0, "mean_queue_s": 0.1,
                "steps": {"decode_only": {"pages_loaded_per_step": 3.0}}}
    files = []
    for i, presets in enumerate([
            {"dense": {"points": [pt(0.5)], "goodput_rate": 0.5}},
            {"sparse-offload+ft": {"points": [pt(1.0), pt(2.0, done=0)], "goodput_rate": 1.0},
             "sparseserve": {"points": [pt(2.0)], "goodput_rate": 9.0}},
            {"sparseserve": {"points": [pt(1.0), pt(2.0)], "goodput_rate": 2.0}}]):
        f = tmp_path / f"r{i}.json"
        f.write_text(json.dumps({"presets": presets, "errors": []}))
        files.append(str(f))
    m = R.merged(files)
    assert list(m["presets"]) == ["dense", "sparse-offload+ft", "sparseserve"]
    assert m["presets"]["sparseserve"]["goodput_rate"] == 2.0  # the later file wins
    png = tmp_path / "ladder.png"
    assert R.main(files + ["--ladder-figure", str(png)]) == 0 and png.stat().st_size > 0
    assert R.compare(m)["sparseserve"]["goodput_x"] == pytest.approx(4.0)
    with pytest.raises(SystemExit, match="fewer than two rungs"):
        R.main([files[0], "--ladder-figure", str(tmp_path / "x.png")])


def test_comparison_line_says_why_there_is_no_goodput_ratio():
    """The report's goodput part names the configuration that met the SLOs at none of its
    rates instead of printing an empty ratio; with both goodputs it prints the ratio."""
    result = {"presets": {"dense": {"goodput_rate": None}, "sparseserve": {"goodput_rate": 7.0}}}
    assert R._goodput_text(result, "sparseserve", {"goodput_x": None}) == \
        "goodput: no ratio (dense met the SLOs at none of its rates)"
    result["presets"]["dense"]["goodput_rate"] = 3.5
    text = R._goodput_text(result, "sparseserve", {"goodput_x": 2.0, "goodput_quality": "exact"})
    assert text == "goodput 2.00x (exact)"
