"""benchmarks/serving_http.py --smoke: a real `sparseserve serve` per preset on a tiny dummy
model (no tokenizer: token-id prompts, so the client asks for logprobs to see each token
arrive), `bench serve` over HTTP against it, the server stopped, ratios to dense printed;
the sparseserve preset once more with --async-scheduling (the server's loop with outputs a
step behind the launches)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_serving_http_smoke(tmp_path):
    out = tmp_path / "h.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serving_http.py"),
                           "--smoke", "--out", str(out),
                           "--presets", "sparseserve,dense,sparseserve+async"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert list(r["presets"]) == ["sparseserve", "dense", "sparseserve+async"]
    for name, rec in r["presets"].items():
        res = rec["result"]
        preset, _, mode = name.partition("+")
        assert "--preset " + preset in rec["server_command"] and rec["start_s"] > 0
        assert ("--async-scheduling" in rec["server_command"]) == (mode == "async")
        assert res["completed"] == 4 and res["failed"] == 0
        # tokens stream although the model has no tokenizer: the first token comes before the
        # end and gaps follow it. A chunk may carry several tokens when the server's stream
        # consumer lags the engine (a loaded CI machine, 8-token requests of a tiny model), so
        # a request has at most output_len - 1 gaps, and the run as a whole has some
        assert all(len(itl) <= n - 1 for itl, n in zip(res["itls"], res["output_lens"]))
        assert sum(len(itl) for itl in res["itls"]) >= 1
        assert all(0 < t < e for t, e in zip(res["ttfts"], res["e2els"]))
        assert res["usage_sources"] == ["server"] and res["mean_itl_ms"] > 0
        assert rec["server_exit_code"] is not None  # the server was stopped
        assert rec["triton_cache"] == "fresh"  # each server started as a user's first one
        assert res["server_metrics"]["triton_compiles"] == 0  # the CPU compiles nothing
    assert "x dense" in proc.stdout and "compiles" in proc.stdout


def test_preset_modifiers_map_to_server_flags():
    """+async / +piecewise / +full / +thread become the server's flags; unknown or conflicting ones are
    an error that names the known modifiers."""
    import argparse

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from serving_http import server_command

    a = argparse.Namespace(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
                           kv_cache_gib=1, load_format="dummy", token_budget=64, host_gib=1,
                           smoke=False)
    cmd = server_command(a, "m", "dense+async+full", 8000)
    assert "--async-scheduling" in cmd and cmd[cmd.index("--cudagraph-mode") + 1] == "FULL"
    assert "--no-engine-process" not in cmd
    cmd = server_command(a, "m", "sparseserve+piecewise+thread", 8000)
    assert cmd[cmd.index("--cudagraph-mode") + 1] == "FULL_AND_PIECEWISE"
    assert "--no-engine-process" in cmd
    cmd = server_command(a, "m", "sparseserve+decode-only", 8000)
    assert cmd[cmd.index("--cudagraph-mode") + 1] == "FULL_DECODE_ONLY"
    for bad in ("dense+fast", "dense+piecewise+full", "dense+full+decode-only"):
        with pytest.raises(ValueError, match="known: \\+async"):
            server_command(a, "m", bad, 8000)
