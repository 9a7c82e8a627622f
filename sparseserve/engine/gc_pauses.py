"""Python's garbage collector on the serving hot path: freeze the start-up heap, and time the
collector's pauses.

Why. A full (generation 2) collection walks every tracked object. After start-up the heap
holds the model's modules and parameters, the CUDA graphs' Python state, Triton's caches, the
tokenizer, ... — hundreds of thousands of objects that live as long as the engine. A step
allocates thousands of small objects (requests' lists, step arrays, tensors' wrappers), so
generation 2 comes due every few steps, and each time the host stops for milliseconds in the
middle of a step while the GPU drains its queue: on the H100 an 8k prompt's last layer-segment
step idled 10-12 ms in one gap of 77-81 ms (docs/results/engine.md, twenty-sixth session).
``gc.freeze()`` moves everything alive at that point to a permanent generation the collector
never scans (vLLM and SGLang do the same after start-up); later garbage is still collected.

Contract:
* ``freeze_startup_heap()``: once the engine (or a tensor-parallel rank) is built: collect,
  then freeze what is left. A second engine in the same process unfreezes the first one's
  objects, collects the dead ones and freezes what is alive.
* ``release_startup_heap()``: an engine's shutdown hands the frozen objects back to the
  collector (``gc.unfreeze()``): frozen objects in reference cycles are never collected, and a
  process that builds engines one after another (benchmarks, tests) must get the last one's
  memory back. The next engine freezes again.
* ``GC_PAUSES``: seconds the collector ran (``total_s``) and collections per generation
  (``collections``), counted from ``install()`` on — benchmarks read differences around a step.
"""
from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then exempt the survivors from later collections.
    Whatever an earlier engine of this process froze is unfrozen first and collected with
    the rest if it died since (tests build hundreds of engines without shutting them down)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def release_startup_heap() -> None:
    """Frozen objects become collectable again (engine shutdown)."""
    gc.unfreeze()


class GcPauses:
    """Time spent in the collector (gc.callbacks), per generation; install() once."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.collections = [0, 0, 0]
        self._t0 = 0.0
        self._installed = False

    def install(self) -> "GcPauses":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1


GC_PAUSES = GcPauses()
