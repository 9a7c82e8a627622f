"""engine/gc_pauses.py: an engine freezes what start-up left alive (no full collection walks
it mid-step), gives it back at shutdown (a dropped engine is collectable), and the pause
counter sees the collector run."""
import gc
import weakref

from sparseserve import LLM
from sparseserve.engine.gc_pauses import GcPauses


class _Cycle:
    def __init__(self):
        self.me = self


def test_engine_freezes_its_startup_heap_and_releases_it_at_shutdown(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    gc.unfreeze()
    before = _Cycle()  # alive at start-up, in a reference cycle
    dead = weakref.ref(before)
    llm = LLM(path, device="cpu", dtype="float32", page_size=16, max_model_len=320)
    try:
        # the engine's modules, parameters, ... are exempt from collections now
        assert gc.get_freeze_count() > 1000
        assert not any(o is before for o in gc.get_objects(generation=2))
        del before
        gc.collect()
        assert dead() is not None  # frozen: a cycle that dies later stays until shutdown
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) > 0
    finally:
        llm.engine.shutdown()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert dead() is None  # shut down: the cycle is collected


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


def test_a_second_engine_collects_what_died_under_the_first_ones_freeze(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    kw = dict(device="cpu", dtype="float32", page_size=16, max_model_len=320)
    first = LLM(path, **kw)
    c = _Cycle()
    LLM(path, **kw)  # freezes c with the rest of the heap ...
    dead = weakref.ref(c)
    del c
    gc.collect()
    assert dead() is not None
    second = LLM(path, **kw)  # ... and a later engine collects it once it is dead
    assert dead() is None
    second.engine.shutdown()
    first.engine.shutdown()
