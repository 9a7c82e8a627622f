"""benchmarks/prefill_mfu.py: the FLOP count against a direct sum over tokens, and --smoke end
to end (every chunk of the prompt is timed once, the tokens add up to the prompt, the MFU is
the FLOPs over the time)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from prefill_mfu import chunk_flops, linear_params  # noqa: E402

MC = SimpleNamespace(hidden_size=64, intermediate_size=96, head_dim=16, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=3, vocab_size=100)


def test_chunk_flops_counts_every_token_and_key():
    per_token = 3 * (64 * 16 * (4 + 4 + 2 + 2) + 3 * 64 * 96)  # q, o, k, v, gate, up, down
    assert linear_params(MC) == per_token
    start, n = 17, 54
    attn = sum(4 * 3 * 4 * 16 * (p + 1) for p in range(start, start + n))
    assert chunk_flops(MC, start, n, 0) == 2 * per_token * n + attn
    assert chunk_flops(MC, start, n, 1) - chunk_flops(MC, start, n, 0) == 2 * 64 * 100


def test_prefill_mfu_smoke(tmp_path):
    out = tmp_path / "mfu.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "prefill_mfu.py"),
                           "--smoke", "--out", str(out), "--profile", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["meta"]["command"]
    assert [x["decode_rows"] for x in r["runs"]] == [0, 2]
    for run in r["runs"]:
        assert {s["prompt"] for s in run["steps"]} == {0, 1}  # prefilled twice
        for prompt in (0, 1):
            steps = [s for s in run["steps"] if s["prompt"] == prompt]
            assert sum(s["tokens"] for s in steps) == run["context"] == 300
            assert [s["start"] for s in steps] == [sum(t["tokens"] for t in steps[:i])
                                                   for i in range(len(steps))]
        # one profile per step of the profiled prompt, each with its top host ops
        assert len(run["profiles"]) == len(steps)
        assert all(0 < len(p["top_self_cpu"]) <= 5 for p in run["profiles"])
        # no CUDA kernels on the CPU: the device breakdown is empty, not made up
        assert all(p["device_ms"] == 0 and p["top_device"] == [] for p in run["profiles"])
        assert run["d2h_method"] is None  # dense: no saves
        # and its Python functions (cProfile): the step itself is among the cumulative top
        for p in run["profiles"]:
            py = p["python"]
            assert py["calls"] > 0 and 0 < len(py["by_own"]) <= 5 and len(py["by_cum"]) <= 5
            assert any(r["fn"].endswith("(step)") and "llm_engine" in r["fn"]
                       for r in py["by_cum"])
            assert all(r["cum_ms"] >= r["own_ms"] >= 0 for r in py["by_own"] + py["by_cum"])
        for s in run["steps"]:
            assert 0 < s["tokens"] <= run["chunk"] and 0 < s["host_ms"] <= s["wall_ms"] * 1.01
            assert abs(s["mfu"] * 790e12 - s["tflops"] * 1e12) < 1e-6 * s["tflops"] * 1e12
    assert "host share" in proc.stdout


def test_prefill_mfu_save_methods(tmp_path):
    """--d2h-methods runs the two-tier preset once per save method, and says which ran."""
    out = tmp_path / "mfu.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "prefill_mfu.py"),
                           "--smoke", "--out", str(out), "--presets", "sparseserve",
                           "--d2h-methods", "copy-engine,gpu-direct"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["decode_rows"], r["d2h_method"]) for r in runs] == [
        (0, "copy-engine"), (0, "gpu-direct"), (2, "copy-engine"), (2, "gpu-direct")]
    for run in runs:  # every prompt token prefilled, by layer segments
        assert sum(s["tokens"] for s in run["steps"] if s["prompt"] == 1) == 300
