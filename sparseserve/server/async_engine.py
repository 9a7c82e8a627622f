"""AsyncLLMEngine: drives the (not thread-safe) LLMEngine from one background thread.

* Every call into the engine happens on the loop thread. The asyncio side talks to it only
  through a thread-safe command queue (add / abort / call / stop) and receives outputs in
  per-HTTP-request asyncio queues (`loop.call_soon_threadsafe`).
* Outputs are cumulative, so a slow consumer just skips to the newest one per request.
* If the loop thread dies (an exception in `step()`), every stream gets `EngineDeadError`,
  `check_health()` raises, and /health answers 503.
* Metrics are fed from the loop thread (see `metrics.ServerMetrics`).
* Forced shutdown: `cut_all()` aborts every running request and raises `ServerShutdownError`
  in its stream, so handlers can still answer (an SSE error event + [DONE], a 503 JSON);
  `num_cut` counts the requests cut that way (the server's exit code reports it).

This module imports no web framework; it needs only the engine contract
(`add_request`, `abort_request`, `step`, `has_unfinished_requests`, `get_stats`,
`check_health`).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

logger = logging.getLogger("sparseserve.server")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down)."""


class ServerShutdownError(EngineDeadError):
    """The server's shutdown timeout passed while this request was still running: it was cut."""


class EngineOverloadedError(RuntimeError):
    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(f"{num_waiting} requests waiting (limit {limit})")
        self.num_waiting = num_waiting
        self.limit = limit


@dataclass(frozen=True)
class Aborted:
    """Pushed into a stream when the engine side aborted the request (shutdown, engine abort)."""

    request_id: str


_CLOSED = object()  # local end-of-stream marker (the consumer side aborted)


@dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue
    track: Any  # metrics.RequestTrack or None


class GenerationStream:
    """Outputs of one HTTP request's engine requests, as `(request_id, RequestOutput | Aborted)`.

    Use it as `async with stream: async for rid, out in stream: ...`; leaving the block (normally,
    by an exception, or by cancellation when the client goes away) aborts whatever is unfinished.
    """

    def __init__(self, engine: "AsyncLLMEngine", request_ids: list[str], sink: asyncio.Queue) -> None:
        self._engine = engine
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._queue = sink

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def abort(self) -> None:
        """Abort every unfinished request of this stream (idempotent, non-blocking)."""
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()
            self._queue.put_nowait(_CLOSED)

    async def __aenter__(self) -> "GenerationStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.abort()

    def __aiter__(self) -> AsyncIterator[tuple[str, Any]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[str, Any]]:
        while self._unfinished:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            latest: dict[str, Any] = {}
            for item in items:
                if item is _CLOSED:
                    return
                if isinstance(item, BaseException):
                    self._unfinished.clear()
                    raise item
                rid, out = item
                latest[rid] = out
            for rid, out in latest.items():
                if rid not in self._unfinished:
                    continue
                if isinstance(out, Aborted) or out.finished:
                    self._unfinished.discard(rid)
                yield rid, out


class AsyncLLMEngine:
    def __init__(self, engine: Any, *, metrics: Any = None, max_waiting_requests: Optional[int] = None,
                 idle_poll_s: float = 0.5, health_check_interval_s: float = 10.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._idle_poll_s = idle_poll_s
        self._health_interval = health_check_interval_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}  # loop thread only
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._num_waiting = 0
        self._num_running = 0
        self._error: Optional[BaseException] = None
        self._stopping = False
        self.num_cut = 0  # engine requests cut by cut_all() / shutdown (loop thread writes)
        self._thread: Optional[threading.Thread] = None
        self._last_health = time.monotonic()
        self.last_stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "AsyncLLMEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sparseserve-engine-loop", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything still running, stop the loop thread and wait for it."""
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self._cmds.put(("stop",))
            self._thread.join(timeout)
        self._fail_pending(ServerShutdownError("the server is shutting down"))

    def cut_all(self) -> None:
        """Refuse new requests, abort every running one and end its stream with
        `ServerShutdownError` (thread-safe, returns at once)."""
        self._stopping = True
        self._cmds.put(("cut",))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def dead_reason(self) -> Optional[str]:
        if self._error is not None:
            return f"{type(self._error).__name__}: {self._error}"
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
        with self._lock:
            return self._num_waiting + self._pending_adds

    def num_running(self) -> int:
        return self._num_running

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
        futures = []
        with self._lock:
            self._pending_adds += len(prompts)
        for rid, prompt in prompts:
            fut = loop.create_future()
            futures.append(fut)
            self._cmds.put(("add", rid, prompt, params, arrival, loop, sink, fut, n, max_tokens))
        stream = GenerationStream(self, [rid for rid, _ in prompts], sink)
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
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
            self._cmds.put(("abort", list(request_ids)))

    async def call(self, fn: Callable[[Any], Any], timeout: Optional[float] = None) -> Any:
        """Run `fn(engine)` on the loop thread between steps and return its result."""
        self.check_health()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(("call", fn, loop, fut))
        return await asyncio.wait_for(fut, timeout)

    # ------------------------------------------------------------------ loop thread

    @staticmethod
    def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
                 exc: Optional[BaseException] = None) -> None:
        def done() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    @staticmethod
    def _deliver(route: _Route, item: Any) -> None:
        try:
            route.loop.call_soon_threadsafe(route.sink.put_nowait, item)
        except RuntimeError:
            pass

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                cmds = self._drain(block=not busy)
                stop = any(c[0] == "stop" for c in cmds)
                need_step = self._process([c for c in cmds if c[0] != "stop"])
                if any(c[0] == "cut" for c in cmds):
                    need_step = self._abort_all() or need_step
                if stop:
                    self._abort_all()
                    if self.engine.has_unfinished_requests():
                        self.engine.step()  # let the engine free the aborted requests' pages
                    self._refresh_stats()
                    return
                if need_step or self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                    self._refresh_stats()
                elif not cmds and time.monotonic() - self._last_health > self._health_interval:
                    self._last_health = time.monotonic()
                    self.engine.check_health()
        except BaseException as e:  # the loop is dead: tell everybody
            self._error = e
            logger.exception("sparseserve engine loop died")
            dead = EngineDeadError(f"engine loop died: {type(e).__name__}: {e}")
            for route in self._routes.values():
                self._deliver(route, dead)
            self._routes.clear()
            self._fail_pending(dead)

    def _drain(self, block: bool) -> list[tuple]:
        cmds = []
        if block:
            try:
                cmds.append(self._cmds.get(timeout=self._idle_poll_s))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _process(self, cmds: list[tuple]) -> bool:
        """Apply add/abort/call commands in order; True if aborts need a step to free pages."""
        need_step = False
        added = 0
        for cmd in cmds:
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt, params, arrival, loop, sink, fut, n, max_tokens = cmd
                added += 1
                if fut.cancelled():
                    continue
                try:
                    self.engine.add_request(rid, prompt, params, arrival_time=arrival)
                except Exception as e:  # ValueError: bad input; anything else: 500
                    self._resolve(loop, fut, exc=e)
                    continue
                track = None
                if self.metrics is not None:
                    from sparseserve.server.metrics import RequestTrack
                    track = RequestTrack(arrival_time=arrival, n=n, max_tokens=max_tokens)
                self._routes[rid] = _Route(loop, sink, track)
                self._resolve(loop, fut, None)
            elif kind == "abort":
                rids = [r for r in cmd[1] if r in self._routes]
                if rids:
                    self.engine.abort_request(rids)
                    need_step = True
                    for rid in rids:
                        route = self._routes.pop(rid)
                        if self.metrics is not None and route.track is not None:
                            self.metrics.observe_abort(route.track)
            elif kind == "call":
                _, fn, loop, fut = cmd
                try:
                    self._resolve(loop, fut, fn(self.engine))
                except Exception as e:
                    self._resolve(loop, fut, exc=e)
        if added:
            with self._lock:
                self._pending_adds -= added
            self._refresh_stats()
        elif need_step:
            self._refresh_stats()
        return need_step

    def _dispatch(self, outputs: list[Any]) -> None:
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted by us already
                continue
            if self.metrics is not None and route.track is not None:
                try:
                    self.metrics.observe_output(out, route.track)
                except Exception:  # metrics must never kill the loop
                    logger.exception("metrics update failed")
            self._deliver(route, (out.request_id, out))
            if out.finished:
                del self._routes[out.request_id]

    def _refresh_stats(self) -> None:
        try:
            stats = dict(self.engine.get_stats())
        except Exception:
            logger.exception("engine.get_stats() failed")
            return
        self.last_stats = stats
        with self._lock:
            self._num_waiting = int(stats.get("num_waiting", 0))
            pending = self._pending_adds
        self._num_running = int(stats.get("num_running", 0))
        if self.metrics is not None:
            self.metrics.update_stats(stats, extra_waiting=pending)

    def _abort_all(self) -> bool:
        """Cut every routed request (ServerShutdownError in its stream); True if any."""
        rids = list(self._routes)
        if rids:
            self.engine.abort_request(rids)
        cut = ServerShutdownError("the server is shutting down")
        for rid in rids:
            route = self._routes.pop(rid)
            if self.metrics is not None and route.track is not None:
                self.metrics.observe_abort(route.track)
            self._deliver(route, cut)
        self.num_cut += len(rids)
        self._fail_pending(cut)
        return bool(rids)

    def _fail_pending(self, exc: BaseException) -> None:
        """Fail every queued add / call with `exc`; a queued stop stays queued."""
        keep = []
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                for c in keep:
                    self._cmds.put(c)
                return
            if cmd[0] == "stop":
                keep.append(cmd)
            if cmd[0] == "add":
                with self._lock:
                    self._pending_adds -= 1
                self._resolve(cmd[5], cmd[7], exc=exc)
            elif cmd[0] == "call":
                self._resolve(cmd[2], cmd[3], exc=exc)
