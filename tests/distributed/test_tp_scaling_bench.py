"""benchmarks/tp_scaling.py without running engines (its CPU smoke, `--smoke`, takes about a
minute and is run by hand): the documented 2-GPU command resolves to Llama-3-8B at TP 1
and 2, and the comparison, targets and table come out of the children's records."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, os.path.abspath(BENCH))

import tp_scaling as T  # noqa: E402


def test_documented_command_resolves(tmp_path):
    import common as C
    a = T.parse_args(["--out", str(tmp_path / "tp.json"), "--tp", "1,2"])
    assert a.tps == [1, 2] and a.parts == ["equal", "perf"] and a.preset == "dense"
    model, cfg, _ = C.resolve_model(a, str(tmp_path), a.max_model_len)
    assert model == "llama-3-8b" and cfg["num_key_value_heads"] == 8
    assert a.input_len + a.output_len <= a.max_model_len
    assert T.parse_args(["--out", "x", "--tp", "2"]).tps == [1, 2]  # TP=1 is the reference


def _perf(cap, thr, ms):
    return {"memory": {"kv_capacity_tokens": cap, "weights_per_rank_gib": 1.0,
                       "kv_bytes_per_rank_gib": 2.0, "max_batch_at_context": cap // 100},
            "decode": {"step_ms": {"median": ms}}, "serve": {"out_tok_s": thr,
                                                              "peak_running": 3}}


def test_summary_ratios_targets_and_table():
    ref = {"tokens": [[1, 2, 3], [4, 5]], "logprobs": [[-1.0, -2.0, -3.0], [-1.0, -1.0]]}
    got = {"tokens": [[1, 2, 9], [4, 5]], "logprobs": [[-1.0, -2.5, -3.0], [-1.25, -1.0]]}
    result = {"settings": {"context": 4096, "decode_room": 512, "batch": 64}, "errors": [],
              "runs": {"equal": {"1": ref, "2": got},
                       "perf": {"1": _perf(1000, 100.0, 20.0), "2": _perf(2200, 160.0, 12.0)}}}
    result["summary"] = s = T.summarize(result)
    assert s["2"]["equal"] == {"tokens_equal": False, "matching_tokens": 4, "tokens": 5,
                               "max_abs_logprob_diff": 0.5}
    assert s["2"]["kv_capacity_x_tp1"] == pytest.approx(2.2)
    assert s["2"]["throughput_x_tp1"] == pytest.approx(1.6)
    assert s["2"]["targets_met"] == {"kv_capacity": True, "throughput": False}
    text = T.table(result)
    assert "TP=2" in text and "4/5" in text and "2.20" in text and "1.60" in text


def test_failed_child_leaves_the_others():
    result = {"settings": {"context": 1, "decode_room": 1, "batch": 1},
              "errors": [{"part": "perf tp=2", "error": "RuntimeError: boom"}],
              "runs": {"perf": {"1": _perf(1000, 100.0, 20.0), "2": {"error": "boom"}}}}
    result["summary"] = T.summarize(result)
    assert "2" not in result["summary"]
    assert "boom" in T.table(result)
