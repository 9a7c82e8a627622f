"""EngineLoop: the background thread that alone calls into the (not thread-safe) LLMEngine.

The asyncio side (`async_engine.AsyncLLMEngine`) talks to it only through `send` (a
thread-safe command queue: `AddCmd`, `AbortCmd`, `CallCmd`, `CUT`, `STOP`); the loop applies the
queued commands between engine steps and routes each step's outputs into the per-HTTP-request
asyncio queues (`loop.call_soon_threadsafe`).

* If the thread dies (an exception in `step()`), every route gets `EngineDeadError`, every
  queued add / call fails with it, and `error` is set.
* Metrics are fed from this thread (see `metrics.ServerMetrics`); a step's engine stats are
  published before its outputs are routed, so /metrics read after a response includes the
  step that produced it.
* `CUT` aborts every routed request and ends its stream with `ServerShutdownError`; `num_cut`
  counts the requests cut that way (the server's exit code reports it). `STOP` does the same and
  ends the thread after one step that lets the engine free the aborted requests' pages.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sparseserve.server.engine_errors import EngineDeadError, ServerShutdownError

logger = logging.getLogger("sparseserve.server")


@dataclass
class AddCmd:
    request_id: str
    prompt: Any
    params: Any
    arrival_time: float
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue  # the GenerationStream's queue
    future: asyncio.Future  # resolved once the engine accepted (None) or refused (exception)
    n: int
    max_tokens: Optional[int]


@dataclass
class AbortCmd:
    request_ids: list[str]


@dataclass
class CallCmd:
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


CUT = "cut"    # abort everything running (forced shutdown); the loop goes on
STOP = "stop"  # abort everything running and end the thread


@dataclass
class Route:
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue
    track: Any  # metrics.RequestTrack or None


class EngineLoop:
    def __init__(self, engine: Any, *, metrics: Any = None, idle_poll_s: float = 0.5,
                 health_check_interval_s: float = 10.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self._idle_poll_s = idle_poll_s
        self._health_interval = health_check_interval_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, Route] = {}  # loop thread only
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._num_waiting = 0
        self.num_running = 0
        self.error: Optional[BaseException] = None
        self.num_cut = 0  # engine requests cut by CUT / STOP (loop thread writes)
        self._last_health = time.monotonic()
        self.last_stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ any thread

    def send(self, cmd: Any) -> None:
        self._cmds.put(cmd)

    def send_adds(self, adds: list[AddCmd]) -> None:
        """Queue adds; they count as waiting (`num_waiting`) until the loop hands them over."""
        with self._lock:
            self._pending_adds += len(adds)
        for cmd in adds:
            self._cmds.put(cmd)

    def num_waiting(self) -> int:
        """Requests not yet running: the engine's waiting queue plus adds not yet handed to it."""
        with self._lock:
            return self._num_waiting + self._pending_adds

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every queued add / call with `exc`; a queued STOP stays queued."""
        keep = []
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                for c in keep:
                    self._cmds.put(c)
                return
            if cmd is STOP:
                keep.append(cmd)
            elif isinstance(cmd, AddCmd):
                with self._lock:
                    self._pending_adds -= 1
                resolve_future(cmd.loop, cmd.future, exc=exc)
            elif isinstance(cmd, CallCmd):
                resolve_future(cmd.loop, cmd.future, exc=exc)

    # ------------------------------------------------------------------ the thread

    def run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                cmds = drain(self._cmds, self._idle_poll_s if not busy else None)
                need_step = self._process([c for c in cmds if c is not STOP])
                if any(c is CUT for c in cmds):
                    need_step = self._abort_all() or need_step
                if any(c is STOP for c in cmds):
                    self._abort_all()
                    if self.engine.has_unfinished_requests():
                        self.engine.step()  # let the engine free the aborted requests' pages
                    self._refresh_stats()
                    return
                if need_step or self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    # stats before outputs: a client that reads /metrics as soon as its
                    # request finished must see the step that finished it (its KV saves), so
                    # such a step reads the device counters; other steps read them a step
                    # late, without waiting for the device (no host sync per step)
                    self._refresh_stats(fresh=any(o.finished for o in outputs)
                                        or not self.engine.has_unfinished_requests())
                    self._dispatch(outputs)
                elif not cmds and time.monotonic() - self._last_health > self._health_interval:
                    self._last_health = time.monotonic()
                    self.engine.check_health()
        except BaseException as e:  # the loop is dead: tell everybody
            self.error = e
            logger.exception("sparseserve engine loop died")
            dead = EngineDeadError(f"engine loop died: {type(e).__name__}: {e}")
            for route in self._routes.values():
                deliver_all(route.loop, [(route.sink, dead)])
            self._routes.clear()
            self.fail_pending(dead)

    def _process(self, cmds: list[Any]) -> bool:
        """Apply add / abort / call commands in order; True if aborts need a step to free pages."""
        need_step = False
        added = 0
        for cmd in cmds:
            if isinstance(cmd, AddCmd):
                added += 1
                self._add(cmd)
            elif isinstance(cmd, AbortCmd):
                rids = [r for r in cmd.request_ids if r in self._routes]
                if rids:
                    self.engine.abort_request(rids)
                    need_step = True
                    for rid in rids:
                        route = self._routes.pop(rid)
                        if self.metrics is not None and route.track is not None:
                            self.metrics.observe_abort(route.track)
            elif isinstance(cmd, CallCmd):
                try:
                    resolve_future(cmd.loop, cmd.future, cmd.fn(self.engine))
                except Exception as e:
                    resolve_future(cmd.loop, cmd.future, exc=e)
        if added:
            with self._lock:
                self._pending_adds -= added
            self._refresh_stats(fresh=False)
        elif need_step:
            self._refresh_stats(fresh=False)
        return need_step

    def _add(self, cmd: AddCmd) -> None:
        if cmd.future.cancelled():
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                    arrival_time=cmd.arrival_time)
        except Exception as e:  # ValueError: bad input; anything else: 500
            resolve_future(cmd.loop, cmd.future, exc=e)
            return
        track = None
        if self.metrics is not None:
            from sparseserve.server.metrics import RequestTrack
            track = RequestTrack(arrival_time=cmd.arrival_time, n=cmd.n, max_tokens=cmd.max_tokens)
        self._routes[cmd.request_id] = Route(cmd.loop, cmd.sink, track)
        resolve_future(cmd.loop, cmd.future, None)

    def _dispatch(self, outputs: list[Any]) -> None:
        # one wake-up of each event loop per step, not one per output
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted by us already
                continue
            if self.metrics is not None and route.track is not None:
                try:
                    self.metrics.observe_output(out, route.track)
                except Exception:  # metrics must never kill the loop
                    logger.exception("metrics update failed")
            batches.setdefault(route.loop, []).append((route.sink, (out.request_id, out)))
            if out.finished:
                del self._routes[out.request_id]
        for loop, items in batches.items():
            deliver_all(loop, items)

    def _refresh_stats(self, fresh: bool = True) -> None:
        try:
            stats = dict(self.engine.get_stats(fresh=fresh))
        except Exception:
            logger.exception("engine.get_stats() failed")
            return
        self.last_stats = stats
        with self._lock:
            self._num_waiting = int(stats.get("num_waiting", 0))
            pending = self._pending_adds
        self.num_running = int(stats.get("num_running", 0))
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
            deliver_all(route.loop, [(route.sink, cut)])
        self.num_cut += len(rids)
        self.fail_pending(cut)
        return bool(rids)


def drain(cmds: queue.SimpleQueue, wait_s: Optional[float]) -> list[Any]:
    """Everything queued; with `wait_s`, first wait up to that long for one command (an idle
    engine blocks here instead of spinning)."""
    out = []
    if wait_s is not None:
        try:
            out.append(cmds.get(timeout=wait_s))
        except queue.Empty:
            return out
    while True:
        try:
            out.append(cmds.get_nowait())
        except queue.Empty:
            return out


def resolve_future(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
                   exc: Optional[BaseException] = None) -> None:
    """Complete an asyncio future from the loop thread."""
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


def deliver_all(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    """Put each (stream queue, item) of `items` into its queue on `loop`, with one wake-up of
    the loop for all of them (every call_soon_threadsafe writes the loop's self-pipe)."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the event loop is closed: nobody is waiting any more
        pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)
