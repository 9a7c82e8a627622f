"""AsyncLLMEngine: the asyncio face of the engine, which runs in one background thread.

* Every call into the (not thread-safe) LLMEngine happens on the loop thread
  (`engine_loop.EngineLoop`); this class only queues commands to it (add / abort / call / cut /
  stop) and hands each HTTP request a `GenerationStream` (`generation_stream.py`) that receives
  its outputs.
* If the loop thread dies (an exception in `step()`), every stream gets `EngineDeadError`,
  `check_health()` raises, and /health answers 503.
* Forced shutdown: `cut_all()` aborts every running request and raises `ServerShutdownError`
  in its stream, so handlers can still answer (an SSE error event + [DONE], a 503 JSON);
  `num_cut` counts the requests cut that way (the server's exit code reports it).

This module imports no web framework; it needs only the engine contract
(`add_request`, `abort_request`, `step`, `has_unfinished_requests`, `get_stats`,
`check_health`).
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Optional

from sparseserve.server.engine_errors import (EngineDeadError, EngineOverloadedError,
                                              ServerShutdownError)
from sparseserve.server.engine_loop import CUT, STOP, AbortCmd, AddCmd, CallCmd, EngineLoop
from sparseserve.server.generation_stream import Aborted, GenerationStream

__all__ = ["Aborted", "AsyncLLMEngine", "EngineDeadError", "EngineOverloadedError",
           "GenerationStream", "ServerShutdownError"]


class AsyncLLMEngine:
    def __init__(self, engine: Any, *, metrics: Any = None, max_waiting_requests: Optional[int] = None,
                 idle_poll_s: float = 0.5, health_check_interval_s: float = 10.0,
                 loop: Any = None) -> None:
        """`engine`: an LLMEngine stepped by a thread of this process; or, with `loop` (an
        `engine_client.EngineProcessLoop`), the EngineInfo of an engine in its own process."""
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._loop = loop if loop is not None else EngineLoop(
            engine, metrics=metrics, idle_poll_s=idle_poll_s,
            health_check_interval_s=health_check_interval_s)
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def in_engine_process(cls, engine_args: Any, *, metrics_factory: Any = None,
                          max_waiting_requests: Optional[int] = None,
                          start_timeout_s: Optional[float] = None) -> "AsyncLLMEngine":
        """The engine built from `engine_args` in its own process (`engine_core.py` says why);
        returns once it is ready. `metrics_factory(info, stats)` -> ServerMetrics or None."""
        from sparseserve.server.engine_client import start_engine_process

        loop = start_engine_process(engine_args, metrics_factory=metrics_factory,
                                    start_timeout_s=start_timeout_s)
        return cls(loop.info, metrics=loop.metrics, max_waiting_requests=max_waiting_requests,
                   loop=loop)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "AsyncLLMEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop.run, name="sparseserve-engine-loop",
                                            daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything still running, stop the loop thread and wait for it."""
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self._loop.send(STOP)
            self._thread.join(timeout)
        self._loop.fail_pending(ServerShutdownError("the server is shutting down"))
        close = getattr(self._loop, "close", None)  # the engine process, if it has one
        if close is not None:
            close(timeout)

    def cut_all(self) -> None:
        """Refuse new requests, abort every running one and end its stream with
        `ServerShutdownError` (thread-safe, returns at once)."""
        self._stopping = True
        self._loop.send(CUT)

    @property
    def num_cut(self) -> int:
        """Engine requests cut by `cut_all()` / `shutdown()`."""
        return self._loop.num_cut

    @property
    def last_stats(self) -> dict[str, Any]:
        """The engine's `get_stats()` after the loop's latest step."""
        return self._loop.last_stats

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._loop.error is None

    @property
    def dead_reason(self) -> Optional[str]:
        error = self._loop.error
        if error is not None:
            return f"{type(error).__name__}: {error}"
        if self._thread is not None and not self._thread.is_alive():
            return "engine loop stopped"
        if self._thread is None:
            return "engine loop not started"
        return None

    def check_health(self) -> None:
        reason = self.dead_reason
        if reason is not None:
            raise EngineDeadError(reason)

    def num_waiting(self) -> int:
        """Requests not yet running: the engine's waiting queue plus adds not yet handed to it."""
        return self._loop.num_waiting()

    def num_running(self) -> int:
        return self._loop.num_running

    # ------------------------------------------------------------------ asyncio side

    async def submit(self, prompts: list[tuple[str, Any]], params: Any,
                     arrival_time: Optional[float] = None, *, n: int = 1,
                     max_tokens: Optional[int] = None) -> GenerationStream:
        """Add one engine request per `(request_id, prompt)`, all with `params`.

        Raises `ValueError` (bad input: the engine's message), `EngineOverloadedError`,
        `EngineDeadError`. On any failure none of the requests stays in the engine.
        """
        self.check_health()
        if self._stopping:
            raise ServerShutdownError("the server is shutting down")
        if self.max_waiting_requests is not None:
            waiting = self.num_waiting()
            if waiting + len(prompts) > self.max_waiting_requests:
                raise EngineOverloadedError(waiting, self.max_waiting_requests)
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        arrival = time.time() if arrival_time is None else arrival_time
        adds = [AddCmd(rid, prompt, params, arrival, loop, sink, loop.create_future(), n, max_tokens)
                for rid, prompt in prompts]
        self._loop.send_adds(adds)
        stream = GenerationStream(self.abort, [rid for rid, _ in prompts], sink)
        try:
            results = await asyncio.gather(*[a.future for a in adds], return_exceptions=True)
        except BaseException:  # cancelled (the client went away while we waited)
            stream.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            stream.abort()
            raise errors[0]
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (thread-safe, returns at once; unknown/finished ids are ignored)."""
        if request_ids:
            self._loop.send(AbortCmd(list(request_ids)))

    async def call(self, fn: Callable[[Any], Any], timeout: Optional[float] = None) -> Any:
        """Run `fn(engine)` on the loop thread between steps and return its result."""
        self.check_health()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._loop.send(CallCmd(fn, loop, fut))
        return await asyncio.wait_for(fut, timeout)
