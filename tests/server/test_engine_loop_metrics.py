"""The engine loop publishes a step's engine stats before it routes the step's outputs: a
client that scrapes /metrics the moment its request finished sees the step that finished it
(the serving benchmark's per-point deltas depend on it)."""
from __future__ import annotations

import asyncio
import threading

from sparseserve import SamplingParams
from sparseserve.server.engine_loop import STOP, AddCmd, EngineLoop
from sparseserve.server.metrics import ServerMetrics
from tests.server.fake_engine import FakeEngine


class _RecordingLoop:
    """Stands in for the asyncio loop a route delivers to: it records, at the moment of each
    delivery, the bytes-saved counter the metrics had then (synchronously, so the check does
    not depend on thread timing)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.seen: list[tuple[object, float]] = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        if args and isinstance(args[0], list):  # a step's [(sink, (request id, RequestOutput))]
            saved = self.metrics.registry.get_sample_value(
                "sparseserve:kv_bytes_saved_total", {"model_name": self.metrics.model_name})
            self.seen.extend((item[1], saved or 0.0) for _, item in args[0])


def test_stats_of_a_step_are_published_before_its_outputs():
    engine = FakeEngine(step_delay=0.0)
    metrics = ServerMetrics(engine.model_name, max_model_len=engine.max_model_len)
    loop = EngineLoop(engine, metrics=metrics, idle_poll_s=0.01)
    rec = _RecordingLoop(metrics)
    aio = asyncio.new_event_loop()
    fut = aio.create_future()
    params = SamplingParams(temperature=0, max_tokens=5)
    loop.send_adds([AddCmd("r", "hello there", params, 0.0, rec, asyncio.Queue(), fut, 1, 5)])
    t = threading.Thread(target=loop.run)
    t.start()
    for _ in range(200):
        if any(out.finished for out, _ in rec.seen):
            break
        threading.Event().wait(0.01)
    loop.send(STOP)
    t.join(timeout=10)
    aio.close()
    assert not t.is_alive() and loop.error is None
    outs = rec.seen
    assert outs and outs[-1][0].finished
    # FakeEngine saves 1024 bytes per step; each output comes from step len(tokens)
    for out, saved in outs:
        steps = len(out.outputs[0].token_ids)
        assert saved >= 1024 * steps, (steps, saved)


def test_server_counts_engine_totals_from_its_start():
    """An engine that already stepped (the start-up warm-up on CUDA, engine/warmup.py) serves
    /metrics counters from zero: create_app starts the metrics from the engine's totals."""
    from sparseserve.server.api import create_app

    engine = FakeEngine(step_delay=0.0)
    engine.hits, engine.steps = 7, 3  # as if three steps had run before the server
    app = create_app(engine)
    try:
        metrics = app.state.engine.metrics
        metrics.update_stats(engine.get_stats())
        read = lambda name: metrics.registry.get_sample_value(  # noqa: E731
            f"sparseserve:{name}", {"model_name": metrics.model_name}) or 0.0
        assert read("kv_bytes_saved_total") == 0.0 and read("kv_cache_hits_total") == 0.0
        engine.steps += 1
        metrics.update_stats(engine.get_stats())
        assert read("kv_bytes_saved_total") == 1024.0
    finally:
        app.state.engine.shutdown(timeout=5)
