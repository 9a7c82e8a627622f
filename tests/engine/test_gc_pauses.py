"""engine/gc_pauses.py: a serving process freezes what start-up left alive (no full
collection walks it mid-serving); an offline LLM does not (a dropped engine must stay
collectable); the pause counter sees the collector run."""
import argparse
import gc
import weakref

from sparseserve import LLM
from sparseserve.engine import gc_pauses
from sparseserve.engine.gc_pauses import GcPauses, freeze_startup_heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_freeze_exempts_the_survivors_and_collects_the_dead_first():
    gc.unfreeze()
    dead_before, alive = _Cycle(), _Cycle()
    gone = weakref.ref(dead_before)
    del dead_before
    frozen = weakref.ref(alive)
    try:
        freeze_startup_heap()
        assert gone() is None  # collected before the freeze
        assert gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())
        del alive
        gc.collect()
        assert frozen() is not None  # frozen: a cycle that dies later is not collected
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen() is None


def test_an_offline_engine_stays_collectable(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    gc.unfreeze()
    llm = LLM(path, device="cpu", dtype="float32", page_size=16, max_model_len=320)
    assert gc.get_freeze_count() == 0
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None


def test_the_server_freezes_after_building_its_engine(tiny_model_dirs, monkeypatch):
    from sparseserve.server import serve_cli

    path, _ = tiny_model_dirs["llama-gqa"]
    seen = {}

    def fake_serve_app(app, host, port, **kw):  # the app is built: do not listen
        seen["served"] = app
        return 0

    def counted_freeze():
        seen["freeze_before_serving"] = "served" not in seen
        gc.collect()  # as freeze_startup_heap, without freezing this test process

    monkeypatch.setattr(serve_cli, "serve_app", fake_serve_app)
    monkeypatch.setattr(gc_pauses, "freeze_startup_heap", counted_freeze)
    parser = argparse.ArgumentParser()
    serve_cli.add_serve_args(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", path, "--device", "cpu", "--dtype", "float32",
                              "--max-model-len", "320", "--page-size", "16",
                              "--no-engine-process"])  # the engine process freezes its own
    assert serve_cli.run_serve(args) == 0
    assert seen["freeze_before_serving"] is True and "served" in seen


def test_pause_counter_times_every_generation():
    pauses = GcPauses().install()
    try:
        for generation in (0, 1, 2):
            n = pauses.collections[generation]
            gc.collect(generation)
            assert pauses.collections[generation] == n + 1
        assert pauses.total_s > 0
    finally:
        gc.callbacks.remove(pauses._callback)
