"""Triton compilations of this process, counted, and flagged when they happen while serving.

Why: Triton compiles a kernel the first time a launch brings a new specialisation (a new
constexpr such as a power-of-two tile, an integer argument that becomes 1 or a multiple of 16,
a differently aligned pointer). The engine's start-up warm-up (engine/warmup.py) compiles the
shapes it can foresee; a compile it missed lands in some user's request: ~0.6 s of one
request's TTFT on the H200 (light8, seventeenth session), and the likeliest cause of the
~1.5 s stall of the H100 HTTP run (docs/results/serving.md, nineteenth session). The counters
go to `LLMEngine.get_stats()` and the server's /metrics
(`sparseserve:triton_compiles_total`, `sparseserve:triton_compile_seconds_total`), so a
benchmark sees compiles among its counter deltas, and each compile after `arm()` logs a
warning naming the kernel and its specialisation.

Mechanism: Triton's `knobs.runtime.jit_cache_hook` (called before a compile; a truthy return
would skip it, so ours returns what a hook installed before it returns) and
`jit_post_compile_hook` (after). Both are process-wide, so this module keeps one watch per
process (`WATCH`). Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) compiles nothing
and calls neither. With tensor parallelism only the driver process's compiles are counted.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

logger = logging.getLogger("sparseserve")


class CompileWatch:
    def __init__(self) -> None:
        self.compiles = 0
        self.seconds = 0.0
        self.armed = False  # True once the engine serves: later compiles are warned about
        # (thread, kernel key) -> start of its compile; Triton's key is hashable (it keys
        # Triton's own kernel cache)
        self._started: dict[tuple, float] = {}
        self._prev_pre: Optional[Callable[..., Any]] = None
        self._prev_post: Optional[Callable[..., Any]] = None
        self._installed = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Hook into Triton (idempotent); False when Triton is missing or has no such hooks."""
        with self._lock:
            if self._installed:
                return True
            try:
                from triton import knobs
            except ImportError:
                return False
            rt = getattr(knobs, "runtime", None)
            if rt is None or not hasattr(rt, "jit_cache_hook"):
                return False
            self._prev_pre, self._prev_post = rt.jit_cache_hook, rt.jit_post_compile_hook
            rt.jit_cache_hook, rt.jit_post_compile_hook = self._before, self._after
            self._installed = True
            return True

    def uninstall(self) -> None:
        """Put back the hooks found at install (a no-op when not installed)."""
        with self._lock:
            if not self._installed:
                return
            from triton import knobs
            knobs.runtime.jit_cache_hook = self._prev_pre
            knobs.runtime.jit_post_compile_hook = self._prev_post
            self._installed = False

    def arm(self) -> None:
        """From now on a compile is a cost some request pays: warn about each one."""
        self.armed = True

    def disarm(self) -> None:
        """An engine is being built (captures, warm-up): its compiles are expected, even when
        an earlier engine of this process (a benchmark's previous preset) armed the watch."""
        self.armed = False

    def stats(self) -> dict[str, float]:
        return {"triton_compiles_total": self.compiles,
                "triton_compile_seconds_total": self.seconds}

    # Triton calls both hooks with keyword arguments (key, repr, fn, compile, is_manual_warmup,
    # already_compiled); **kw keeps us working when a Triton version adds one.
    def _before(self, *, key: Any = None, **kw: Any) -> Any:
        self._started[(threading.get_ident(), key)] = time.perf_counter()
        return self._prev_pre(key=key, **kw) if self._prev_pre else None

    def _after(self, *, key: Any = None, repr: str = "?", **kw: Any) -> Any:
        t0 = self._started.pop((threading.get_ident(), key), None)
        took = time.perf_counter() - t0 if t0 is not None else 0.0
        with self._lock:
            self.compiles += 1
            self.seconds += took
        if self.armed:
            logger.warning("Triton compiled a kernel while serving (%.2f s; the start-up "
                           "warm-up did not cover this specialisation): %s", took,
                           describe_compile(repr, kw.get("compile")))
        return self._prev_post(key=key, repr=repr, **kw) if self._prev_post else None


def describe_compile(repr: str, compile: Any) -> str:
    """The kernel and every argument's specialisation from the hook's `compile` dict
    (signature {name: type}, constants {(index,): value}, configs [{(index,): attrs}]), e.g.
    `_probe_kernel(pages_ptr: *i32/16, N: i32, FRESH=2)`: /16 marks a pointer or integer
    specialised as divisible by 16. Triton 3.6's own `repr` lists the first argument only
    (it indexes the cache key string), which cannot say what the warm-up missed. Falls back
    to `repr` when the dict is not of that shape."""
    try:
        sig, consts = compile["signature"], compile.get("constants") or {}
        attrs = (compile.get("configs") or [{}])[0]
        parts = [f"{name}={consts.get((i,))!r}" if ty == "constexpr"
                 else f"{name}: {ty}{'/16' if attrs.get((i,)) else ''}"
                 for i, (name, ty) in enumerate(sig.items())]
    except (TypeError, KeyError, AttributeError, IndexError):
        return repr
    return f"{repr.split('[', 1)[0]}({', '.join(parts)})"


WATCH = CompileWatch()
