"""benchmarks/trace_gaps.py on hand-built traces: every gap of the compute (every kernel but the
saves, on any stream) found, its cause read from its kernel's launch time, the saves' work
inside it measured; a graph's bodies on streams of their own make no gap."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from trace_gaps import analyse, overlap  # noqa: E402


def kernel(name, ts, dur, stream, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream,
            "args": {"stream": stream, "correlation": corr}}


def launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def trace():
    # compute stream 7: [0, 100) [100, 300) gap [300, 400) [400, 500) gap [500, 517) [517, 900)
    # side stream 9, the saves: [320, 370) (inside the first gap), [600, 650)
    save = "_gpu_direct_kernel"
    ev = [kernel("a", 0, 100, 7, 1), kernel("b", 100, 200, 7, 2), kernel("c", 400, 100, 7, 3),
          kernel("d", 517, 383, 7, 4), kernel(save, 320, 50, 9, 5), kernel(save, 600, 50, 9, 6),
          launch(0, 1), launch(1, 2), launch(390, 3), launch(3, 4), launch(4, 5), launch(5, 6),
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 385, "dur": 10},
          {"ph": "X", "cat": "cpu_op", "name": "step", "ts": 0, "dur": 900}]
    return ev


def test_gaps_and_causes():
    r = analyse(trace(), min_gap=10)
    assert r["span_us"] == 900 and r["compute_busy_us"] == 783
    assert [(g["start_us"], g["gap_us"]) for g in r["gaps"]] == [(300, 100), (500, 17)]
    host, dev = r["gaps"]
    # kernel c was launched at 390, after its gap began at 300: the GPU waited for the host,
    # inside the innermost CPU op around the launch
    assert host["cause"] == "host" and host["launched_in"] == "aten::mm"
    assert host["side_stream_busy_us"] == 50
    # kernel d was launched at 3, long before: it waited on the device
    assert dev["cause"] == "device" and dev["launched_in"] is None
    assert r["idle_by_cause_us"] == {"host": 100, "device": 17}
    assert analyse(trace(), min_gap=20)["idle_us"] == 100  # the short gap is under the bar


def test_graph_streams_are_compute():
    """A replayed graph's forked bodies run on streams of their own (one per layer graph) while
    its save shows on the capturing stream: the compute is their union, the save side work."""
    ev = [kernel("layer0", 0, 100, 250, 1), kernel("layer1", 100, 100, 252, 2),
          kernel("_gpu_direct_kernel", 50, 40, 7, 3), kernel("layer2", 300, 50, 254, 4),
          launch(0, 1), launch(1, 2), launch(2, 3), launch(3, 4)]
    r = analyse(ev, min_gap=10)
    assert [(g["start_us"], g["gap_us"]) for g in r["gaps"]] == [(200, 100)]
    assert r["compute_busy_us"] == 250 and r["gaps"][0]["side_stream_busy_us"] == 0
    # no side work ('': the save counted as compute, inside layer0's interval)
    r = analyse(ev, min_gap=10, side_kernels="")
    assert r["compute_busy_us"] == 250 and [g["gap_us"] for g in r["gaps"]] == [100]


def test_driver_launches_count():
    """A Triton kernel's launch is a driver call (cuLaunchKernelEx, "cuda_driver"): a gap it
    ends is the host's when that call returned late; a runtime call wrapping a driver call of
    the same correlation id enqueues when the inner call returns."""
    def driver(ts, corr, dur=2):
        return {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": ts,
                "dur": dur, "args": {"correlation": corr}}

    base = [kernel("a", 0, 100, 7, 1), kernel("triton", 400, 100, 7, 2), launch(0, 1)]
    assert analyse(base + [driver(390, 2)], min_gap=10)["gaps"][0]["cause"] == "host"
    wrapped = base + [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 20,
                       "dur": 380, "args": {"correlation": 2}}, driver(21, 2)]
    assert analyse(wrapped, min_gap=10)["gaps"][0]["cause"] == "device"  # enqueued at 23
    assert analyse(base, min_gap=10)["gaps"][0]["cause"] == "device"  # no launch recorded


def test_overlap_merges_intervals():
    iv = [(0, 10, None), (5, 20, None), (30, 40, None)]
    assert overlap(0, 100, iv) == 30 and overlap(8, 35, iv) == 17 and overlap(50, 60, iv) == 0


def test_cli_writes_summary(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": trace()}))
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "trace_gaps.py"),
                           str(path), "--min-gap-us", "10", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "idle 0.1 ms in 2 gaps" in proc.stdout
    assert json.loads(out.read_text())[str(path)]["idle_us"] == 117
