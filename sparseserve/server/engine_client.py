"""EngineProcessLoop: `AsyncLLMEngine`'s loop when the engine runs in its own process.

It has `EngineLoop`'s face (`send`, `send_adds`, `num_waiting`, `fail_pending`, `run`,
`num_running`, `num_cut`, `last_stats`, `error`), so the asyncio side does not know where the
engine is. `run` (the loop thread) now only receives: it blocks on the engine's pipe without
the GIL, rebuilds each step's cumulative outputs from deltas (`output_deltas`), feeds the
Prometheus metrics and routes outputs to the per-request asyncio queues, one event-loop
wake-up per step. Commands go straight down the pipe from the caller's thread.

* The engine process dies (a crash, the OOM killer): its pipe ends, every stream gets
  `EngineDeadError`, queued adds and calls fail with it, `error` is set.
* `call(fn)` runs `fn(engine)` in the engine process: `fn` must pickle (a module-level
  function, not a lambda); otherwise the call fails at once with a TypeError saying so.
* `close()` (after the loop thread ended) joins the process, killing it if it hangs.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import pickle
import threading
from typing import Any, Optional

from sparseserve.server.engine_errors import EngineDeadError, ServerShutdownError
from sparseserve.server.engine_loop import (CUT, STOP, AbortCmd, AddCmd, CallCmd, Route,
                                            deliver_all, resolve_future)
from sparseserve.server.output_deltas import DeltaAssembler

logger = logging.getLogger("sparseserve.server")


def start_engine_process(engine_args: Any, *, metrics_factory: Any = None,
                         start_timeout_s: Optional[float] = None) -> "EngineProcessLoop":
    """Spawn the engine process and wait until its engine is built (weights loaded, graphs
    captured). Raises RuntimeError with the engine's error when it could not start.
    `metrics_factory(info, stats)` -> the ServerMetrics fed by the loop (or None)."""
    from sparseserve.server.engine_core import run_engine_core

    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    cmd_recv, cmd_send = ctx.Pipe(duplex=False)
    out_recv, out_send = ctx.Pipe(duplex=False)
    # not a daemon: with tensor parallelism the engine starts its own worker processes (a
    # daemon may not); it ends when our pipe closes, however this process ends
    proc = ctx.Process(target=run_engine_core, args=(engine_args, cmd_recv, out_send),
                       name="sparseserve-engine", daemon=False)
    proc.start()
    cmd_recv.close()  # the child's ends: closing ours lets each side see the other's exit
    out_send.close()
    if not out_recv.poll(start_timeout_s):
        proc.kill()
        raise RuntimeError(f"the engine process did not start in {start_timeout_s} s")
    try:
        msg = out_recv.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"the engine process exited with {proc.exitcode} while starting "
                           "(its log is above)") from None
    if msg[0] != "ready":
        proc.join(30)
        raise RuntimeError(f"the engine did not start: {msg[1]}")
    _, info, stats = msg
    metrics = metrics_factory(info, stats) if metrics_factory is not None else None
    return EngineProcessLoop(proc, cmd_send, out_recv, info, stats, metrics)


class EngineProcessLoop:
    def __init__(self, proc: Any, cmd_conn: Any, out_conn: Any, info: Any,
                 stats: dict[str, Any], metrics: Any) -> None:
        self.proc = proc
        self.info = info  # EngineInfo: AsyncLLMEngine.engine in this mode
        self.metrics = metrics
        self._cmd = cmd_conn
        self._out = out_conn
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._routes: dict[str, Route] = {}  # accepted requests
        self._adds: dict[str, AddCmd] = {}    # sent, not yet accepted or refused
        self._aborted_adds: set[str] = set()  # aborted before they were accepted
        self._calls: dict[int, CallCmd] = {}
        self._call_ids = itertools.count()
        self._assembler = DeltaAssembler()
        self._num_waiting = 0
        self.num_running = 0
        self.error: Optional[BaseException] = None
        self.num_cut = 0
        self.last_stats: dict[str, Any] = dict(stats)

    # ------------------------------------------------------------------ any thread

    def send(self, cmd: Any) -> None:
        if isinstance(cmd, AddCmd):
            self.send_adds([cmd])
        elif isinstance(cmd, AbortCmd):
            with self._lock:
                rids = [r for r in cmd.request_ids if r in self._routes]
                routes = [self._routes.pop(r) for r in rids]
                for rid in rids:
                    self._assembler.drop(rid)
                # not accepted yet: the engine process adds it first, then aborts it
                early = [r for r in cmd.request_ids if r in self._adds]
                self._aborted_adds.update(early)
            for route in routes:
                if self.metrics is not None and route.track is not None:
                    self.metrics.observe_abort(route.track)
            if rids or early:
                self._send(("abort", rids + early))
        elif isinstance(cmd, CallCmd):
            try:
                pickle.dumps(cmd.fn)
            except Exception as e:  # noqa: BLE001 - a lambda, a closure
                resolve_future(cmd.loop, cmd.future, exc=TypeError(
                    f"the engine runs in its own process: call() needs a function that pickles "
                    f"(a module-level function), got {cmd.fn!r} ({e})"))
                return
            with self._lock:
                call_id = next(self._call_ids)
                self._calls[call_id] = cmd
            self._send(("call", call_id, cmd.fn))
        elif cmd is CUT:
            self._send(("cut",))
        elif cmd is STOP:
            self._send(("stop",))
        else:
            raise ValueError(f"unknown engine command {cmd!r}")

    def send_adds(self, adds: list[AddCmd]) -> None:
        with self._lock:
            for cmd in adds:
                self._adds[cmd.request_id] = cmd
        self._send(("add", [(c.request_id, c.prompt, c.params, c.arrival_time) for c in adds]))

    def num_waiting(self) -> int:
        """Requests not yet running: the engine's waiting queue plus adds not yet accepted."""
        with self._lock:
            return self._num_waiting + len(self._adds)

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every add / call not yet answered with `exc`."""
        with self._lock:
            adds, self._adds = list(self._adds.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for cmd in adds + calls:
            resolve_future(cmd.loop, cmd.future, exc=exc)

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._cmd.send(msg)
        except (OSError, EOFError, ValueError):  # the engine process is gone
            pass  # run() sees the closed pipe and fails everything with EngineDeadError

    # ------------------------------------------------------------------ the loop thread

    def run(self) -> None:
        try:
            while True:
                try:
                    msg = self._out.recv()
                except (EOFError, OSError):
                    raise EngineDeadError(
                        f"the engine process exited (exit code {self.proc.exitcode})") from None
                kind = msg[0]
                if kind == "step":
                    self._on_step(msg[1], msg[2])
                elif kind == "added":
                    self._on_added(msg[1], msg[2])
                elif kind == "called":
                    with self._lock:
                        cmd = self._calls.pop(msg[1], None)
                    if cmd is not None:
                        resolve_future(cmd.loop, cmd.future, msg[2], msg[3])
                elif kind == "cut":
                    self._on_cut(msg[1])
                elif kind == "stopped":
                    self._on_cut(list(self._routes))
                    self._update_stats(msg[1])
                    return
                elif kind == "dead":
                    raise EngineDeadError(msg[1])
        except BaseException as e:  # noqa: BLE001 - the engine is gone: tell everybody
            self.error = e
            logger.error("sparseserve engine process failed: %s", e)
            dead = e if isinstance(e, EngineDeadError) else EngineDeadError(str(e))
            with self._lock:
                routes, self._routes = list(self._routes.values()), {}
            for route in routes:
                deliver_all(route.loop, [(route.sink, dead)])
            self.fail_pending(dead)

    def _on_added(self, results: list[tuple[str, Any]], stats: dict[str, Any]) -> None:
        from sparseserve.server.metrics import RequestTrack

        for rid, exc in results:
            with self._lock:
                cmd = self._adds.pop(rid, None)
                aborted = rid in self._aborted_adds
                self._aborted_adds.discard(rid)
            if cmd is None:
                continue
            if exc is None and cmd.future.cancelled() and not aborted:
                self._send(("abort", [rid]))  # the submitter went away while it was added
            elif exc is None and not aborted:
                track = None
                if self.metrics is not None:
                    track = RequestTrack(arrival_time=cmd.arrival_time, n=cmd.n,
                                         max_tokens=cmd.max_tokens)
                with self._lock:
                    self._routes[rid] = Route(cmd.loop, cmd.sink, track)
            resolve_future(cmd.loop, cmd.future, None, exc)
        self._update_stats(stats)

    def _on_step(self, deltas: list[tuple], stats: dict[str, Any]) -> None:
        self._update_stats(stats)  # stats before outputs, as in EngineLoop
        batches: dict[Any, list[tuple[Any, Any]]] = {}
        with self._lock:
            wanted = [(self._routes.get(d[0]), d) for d in deltas]
        for route, delta in wanted:
            if route is None:  # aborted here already
                continue
            out = self._assembler.apply(delta)
            if out is None:
                continue
            if self.metrics is not None and route.track is not None:
                try:
                    self.metrics.observe_output(out, route.track)
                except Exception:  # noqa: BLE001 - metrics must never kill the loop
                    logger.exception("metrics update failed")
            batches.setdefault(route.loop, []).append((route.sink, (out.request_id, out)))
            if out.finished:
                with self._lock:
                    self._routes.pop(out.request_id, None)
        for loop, items in batches.items():
            deliver_all(loop, items)

    def _on_cut(self, rids: list[str]) -> None:
        cut = ServerShutdownError("the server is shutting down")
        with self._lock:
            routes = [self._routes.pop(r) for r in rids if r in self._routes]
        for rid in rids:
            self._assembler.drop(rid)
        self.num_cut += len(routes)  # before the streams hear of it: they may read it at once
        for route in routes:
            if self.metrics is not None and route.track is not None:
                self.metrics.observe_abort(route.track)
            deliver_all(route.loop, [(route.sink, cut)])
        # adds sent before the cut reached the engine fail like the running requests (the
        # engine may accept them after the cut: abort them there); calls still get answers
        with self._lock:
            adds, self._adds = list(self._adds.values()), {}
        if adds:
            self._send(("abort", [c.request_id for c in adds]))
        for cmd in adds:
            resolve_future(cmd.loop, cmd.future, exc=cut)

    def _update_stats(self, stats: dict[str, Any]) -> None:
        self.last_stats = stats
        with self._lock:
            self._num_waiting = int(stats.get("num_waiting", 0))
            pending = len(self._adds)
        self.num_running = int(stats.get("num_running", 0))
        if self.metrics is not None:
            self.metrics.update_stats(stats, extra_waiting=pending)

    # ------------------------------------------------------------------ after the loop

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the engine process to end (it does after STOP or when our pipe closes)."""
        self._cmd.close()
        self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("the engine process did not stop in %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.join(5)
        self._out.close()

