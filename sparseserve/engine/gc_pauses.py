"""Python's garbage collector on the serving hot path: freeze the start-up heap of a serving
process, and time the collector's pauses.

Why. A full (generation 2) collection walks every tracked object. After start-up the heap
holds the model's modules and parameters, the CUDA graphs' Python state, Triton's caches, the
tokenizer, ... — 342k objects with the embedded SmolLM2, whose full collection takes 122 ms on
the 2-core CPU machine. A long-running server promotes request state to the old generation
step after step, so full collections come due now and then, each a pause of the engine loop
in the middle of serving. ``gc.freeze()`` moves everything alive at that point to a permanent
generation the collector never scans (vLLM and SGLang do the same after start-up); later
garbage is still collected.

Only processes that serve one engine for their whole life freeze (``sparseserve serve``'s
in-process engine, its engine process, each tensor-parallel rank): frozen objects in reference
cycles are never collected, so an offline ``LLM`` that a script drops and replaces (tests,
benchmarks, the vLLM habit ``del llm; gc.collect()``) must stay collectable.

Contract:
* ``freeze_startup_heap()``: collect what start-up left behind, then freeze the survivors.
* ``GC_PAUSES``: seconds the collector ran (``total_s``) and collections per generation
  (``collections``), counted from ``install()`` on — benchmarks read differences around a step.
"""
from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then exempt the survivors from later collections."""
    gc.collect()
    gc.freeze()


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
