"""The engine process: `run_engine_core` is the target of the process `engine_client` starts.

Why a process: in one process the HTTP event loop (JSON, SSE, uvicorn) and the engine thread
share one GIL, so every streamed chunk is time the engine step waits for (vLLM V1 moved its
engine core into its own process for the same reason). Here the engine owns its interpreter;
the front end only tokenizes, routes and streams.

Messages (pickled over two one-way pipes):

* in: `("add", [(request_id, prompt, params, arrival_time)])`, `("abort", [request_id])`,
  `("call", call_id, fn)`, `("cut",)`, `("stop",)`; end of file = stop (the front end died).
* out: `("ready", info)` once (or `("dead", message)`), then `("added", [(request_id, exc)])`,
  `("step", [delta], stats)` (`output_deltas`), `("called", call_id, result, exc)`,
  `("cut", [request_id])`, `("stopped", stats)` last, or `("dead", message)` when the loop dies.

The loop is `EngineLoop.run`'s in shape: commands are applied between steps, a step's stats
travel with its outputs (read fresh when a request finished, else a step late), the health
check runs when idle.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
from typing import Any

from sparseserve.server.engine_loop import drain
from sparseserve.server.output_deltas import DeltaEncoder

logger = logging.getLogger("sparseserve.server")
STOP_MSG = ("stop",)


def run_engine_core(engine_args: Any, cmd_conn: Any, out_conn: Any,
                    idle_poll_s: float = 0.5, health_check_interval_s: float = 10.0) -> None:
    """Build the engine from `engine_args` and serve the front end's commands until stop."""
    # Ctrl-C reaches the whole process group: the front end decides when the engine stops
    # (it drains requests first); the engine still ends when the front end's pipe closes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s (engine): %(message)s")
    try:
        from sparseserve.engine.gc_pauses import freeze_startup_heap
        from sparseserve.engine.llm_engine import LLMEngine
        from sparseserve.server.engine_info import EngineInfo

        engine = LLMEngine.from_engine_args(engine_args)
        freeze_startup_heap()  # this process serves one engine until it exits
        out_conn.send(("ready", EngineInfo.of(engine), engine.get_stats()))
    except BaseException as e:  # noqa: BLE001 - the front end reports it and exits
        logger.exception("the engine did not start")
        out_conn.send(("dead", f"{type(e).__name__}: {e}"))
        return
    EngineCore(engine, cmd_conn, out_conn, idle_poll_s, health_check_interval_s).run()
    # the engine is shut down and the front end has its last message: leave without the
    # interpreter's teardown, where native thread pools still alive (the pipe reader blocked
    # in recv, torch's workers) end in std::terminate ("terminate called without an active
    # exception") and a non-zero exit code
    logging.shutdown()
    out_conn.close()
    os._exit(0)


class EngineCore:
    def __init__(self, engine: Any, cmd_conn: Any, out_conn: Any, idle_poll_s: float,
                 health_check_interval_s: float) -> None:
        self.engine = engine
        self._out = out_conn
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()
        self._encoder = DeltaEncoder()
        self._idle_poll_s = idle_poll_s
        self._health_interval = health_check_interval_s
        self._last_health = time.monotonic()
        # the pipe is read by its own thread, so a large prompt arriving never stalls a step
        threading.Thread(target=self._read, args=(cmd_conn,), name="sparseserve-engine-in",
                         daemon=True).start()

    def _read(self, conn: Any) -> None:
        while True:
            try:
                self._cmds.put(conn.recv())
            except (EOFError, OSError):
                self._cmds.put(STOP_MSG)
                return

    def run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                cmds = drain(self._cmds, self._idle_poll_s if not busy else None)
                need_step = False
                for cmd in cmds:
                    if cmd[0] == "stop":
                        self._abort(list(self._live))
                        if engine.has_unfinished_requests():
                            engine.step()  # frees the aborted requests' pages
                        self._out.send(("stopped", engine.get_stats()))
                        engine.shutdown()
                        return
                    need_step = self._apply(cmd) or need_step
                if need_step or engine.has_unfinished_requests():
                    outputs = engine.step()
                    fresh = any(o.finished for o in outputs) or not engine.has_unfinished_requests()
                    deltas = []
                    for out in outputs:
                        if out.request_id in self._live:
                            deltas.append(self._encoder.encode(out))
                            if out.finished:
                                self._live.discard(out.request_id)
                    self._out.send(("step", deltas, engine.get_stats(fresh=fresh)))
                elif not cmds and time.monotonic() - self._last_health > self._health_interval:
                    self._last_health = time.monotonic()
                    engine.check_health()
        except BaseException as e:  # noqa: BLE001 - the front end fails every request with it
            logger.exception("sparseserve engine loop died")
            try:
                self._out.send(("dead", f"engine loop died: {type(e).__name__}: {e}"))
            except (OSError, EOFError):
                pass

    def _apply(self, cmd: tuple) -> bool:
        """Apply one command; True when aborted requests need a step to free their pages."""
        kind = cmd[0]
        if kind == "add":
            results = []
            for rid, prompt, params, arrival in cmd[1]:
                try:
                    self.engine.add_request(rid, prompt, params, arrival_time=arrival)
                except Exception as e:  # noqa: BLE001 - bad input: the front end answers 400
                    results.append((rid, portable(e)))
                    continue
                self._live.add(rid)
                results.append((rid, None))
            self._out.send(("added", results, self.engine.get_stats(fresh=False)))
            return False
        if kind == "abort":
            return self._abort([r for r in cmd[1] if r in self._live])
        if kind == "call":
            try:
                self._out.send(("called", cmd[1], cmd[2](self.engine), None))
            except Exception as e:  # noqa: BLE001 - raised in the caller
                self._out.send(("called", cmd[1], None, portable(e)))
            return False
        if kind == "cut":
            rids = list(self._live)
            self._abort(rids)
            self._out.send(("cut", rids))
            return bool(rids)
        raise ValueError(f"unknown engine command {kind!r}")

    def _abort(self, rids: list[str]) -> bool:
        if not rids:
            return False
        self.engine.abort_request(rids)
        for rid in rids:
            self._live.discard(rid)
            self._encoder.drop(rid)
        return True


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a ValueError / RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        cls = ValueError if isinstance(exc, ValueError) else RuntimeError
        return cls(str(exc))
