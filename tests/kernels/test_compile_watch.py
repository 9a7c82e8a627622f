"""kernels/compile_watch.py: Triton compilations counted through Triton's own hooks, earlier
hooks kept working, a warning only once the engine serves, and the counters reaching
`get_stats()`, the server's /metrics and `bench serve`'s counter deltas. (No compiler runs on
the CPU: the hooks are called here exactly as triton/runtime/jit.py calls them around a
compile; tests/gpu/test_compile_watch_gpu.py compiles for real.)"""
import inspect
import logging

import pytest

knobs = pytest.importorskip("triton.knobs")

from sparseserve.kernels.compile_watch import CompileWatch  # noqa: E402

pytestmark = pytest.mark.cpu_only("Triton's hooks are called by hand; the GPU test compiles")


@pytest.fixture
def hooks():
    """Triton's process-wide hooks restored after the test."""
    rt = knobs.runtime
    saved = rt.jit_cache_hook, rt.jit_post_compile_hook
    yield rt
    rt.jit_cache_hook, rt.jit_post_compile_hook = saved


def _compile(rt, name: str = "k[num_warps=4](x: *fp32)") -> None:
    """What triton/runtime/jit.py's _do_compile does around a compile."""
    kw = dict(key=("sig", name), repr=name, fn=None, compile={"key": name},
              is_manual_warmup=False, already_compiled=False)
    assert not rt.jit_cache_hook(**kw)  # a truthy answer would skip the compile
    rt.jit_post_compile_hook(**kw)


def test_hooks_take_every_argument_of_tritons_protocol():
    params = [p for p in inspect.signature(knobs.JITHook.__call__).parameters if p != "self"]
    assert {"key", "repr"} <= set(params)
    w = CompileWatch()
    kw = {p: None for p in params}
    kw["repr"] = "k"
    assert not w._before(**kw)
    w._after(**kw)
    assert w.compiles == 1


def test_counts_keeps_earlier_hooks_and_warns_only_when_armed(hooks, caplog):
    calls = []
    hooks.jit_cache_hook = lambda **kw: calls.append(("pre", kw["repr"])) or False
    hooks.jit_post_compile_hook = lambda **kw: calls.append(("post", kw["repr"]))
    w = CompileWatch()
    assert w.install() and w.install()  # idempotent: hooks not chained to themselves
    caplog.set_level(logging.WARNING, logger="sparseserve")
    _compile(hooks, "warm_kernel")
    assert w.compiles == 1 and w.seconds >= 0 and not caplog.records
    w.arm()
    _compile(hooks, "late_kernel[num_warps=8](n: i32)")
    assert w.stats()["triton_compiles_total"] == 2
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "late_kernel[num_warps=8](n: i32)" in caplog.text and "warm-up" in caplog.text
    assert calls == [("pre", "warm_kernel"), ("post", "warm_kernel"),
                     ("pre", "late_kernel[num_warps=8](n: i32)"),
                     ("post", "late_kernel[num_warps=8](n: i32)")]
    w.uninstall()
    _compile(hooks, "after")  # the earlier hooks alone again
    assert w.compiles == 2 and calls[-1] == ("post", "after")


def test_a_new_engine_disarms_until_its_own_warm_up(hooks, caplog):
    """Two engines in one process (a benchmark's presets one after another): the second's
    captures and warm-up compile while the first's arm() still stands; disarm() (called when
    an engine starts building) keeps those out of the warnings, and they still count."""
    w = CompileWatch()
    w.install()
    caplog.set_level(logging.WARNING, logger="sparseserve")
    w.arm()
    w.disarm()
    _compile(hooks, "second_engine_capture")
    assert not caplog.records and w.compiles == 1
    w.arm()
    _compile(hooks, "served")
    w.uninstall()
    assert len(caplog.records) == 1 and "served" in caplog.text


def test_warning_names_every_arguments_specialisation(hooks, caplog):
    """The warning spells out the specialisation from the hook's compile dict in Triton's
    format (attrs parsed by Triton's CUDA backend): which pointer was 16-byte aligned, which
    integer divisible by 16, each constexpr's value. Triton 3.6's own repr stops after the
    first argument."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    signature = {"pages_ptr": "*i32", "step_ptr": "*i64", "N": "i32", "FRESH": "constexpr"}
    compile = {"key": "k", "signature": signature, "constants": {(3,): 2},
               "configs": [{(0,): backend.parse_attr("D"), (1,): backend.parse_attr(""),
                            (2,): backend.parse_attr("D")}]}
    w = CompileWatch()
    w.install()
    w.arm()
    caplog.set_level(logging.WARNING, logger="sparseserve")
    kw = dict(key="k", repr="_probe_kernel[num_warps=4](pages_ptr: (", fn=None,
              compile=compile, is_manual_warmup=False, already_compiled=False)
    hooks.jit_cache_hook(**kw)
    hooks.jit_post_compile_hook(**kw)
    w.uninstall()
    assert "_probe_kernel(pages_ptr: *i32/16, step_ptr: *i64, N: i32/16, FRESH=2)" in caplog.text


def test_counters_reach_metrics_and_bench_deltas(tiny_model_dirs, hooks):
    """A real engine's stats carry the counters; the server exports them; bench serve's
    deltas read them (0 compiles is a measurement, not a missing name)."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from sparseserve import LLM
    from sparseserve.bench import serve_prometheus
    from sparseserve.kernels import compile_watch
    from sparseserve.server.metrics import ServerMetrics

    path, _ = tiny_model_dirs["llama-gqa"]
    engine = LLM(path, device="cpu", max_model_len=128, max_num_seqs=2).engine
    watch = compile_watch.WATCH
    before_compiles = watch.compiles
    stats = engine.get_stats()
    assert stats["triton_compiles_total"] == before_compiles
    metrics = ServerMetrics("m", process_metrics=False)
    metrics.start_from(stats)
    before = generate_latest(metrics.registry).decode()
    installed_before = watch._installed
    assert watch.install()
    try:
        _compile(hooks, "served_kernel")  # as if a step had compiled one
    finally:
        if not installed_before:
            watch.uninstall()
    metrics.update_stats(engine.get_stats())
    after = generate_latest(metrics.registry).decode()
    d = serve_prometheus.deltas(before, after)
    assert d["triton_compiles"] == 1.0 and d["triton_compile_s"] >= 0.0
    assert "triton_compiles" not in d["missing"]
    assert d["save_wait_s"] == 0.0  # exported (a resident engine never waits on saves)
