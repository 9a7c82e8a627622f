"""Executors: how LLMEngine runs a step on the model, in this process or over TP ranks.

Both offer the interface LLMEngine calls:
    execute(SchedulerOutput) -> RunnerOutput
    launch(SchedulerOutput) -> handle, collect(handle) -> RunnerOutput
                                     (async scheduling; UniprocExecutor only)
    release(rows, request_ids, pages)
    offload_stats(fresh=True) -> dict | None   (two-tier cache counters, summed over ranks,
                                      with "total_slots" = device slots x layers; fresh=False:
                                      without waiting for the device, a step late)
    graph_info() -> {"batch_sizes": [...] | None, "error": str | None}
                                     (the decode CUDA graphs rank 0 captured; None: eager)
    check_invariants(), check_health(), shutdown()   (shutdown also closes the two-tier
                                      cache's transfer threads; idempotent)
and `runner`: the in-process ModelRunner (UniprocExecutor) or None (MultiprocExecutor);
`local_runner(purpose)` returns it or raises a clear error for what needs a rank's internals
(the fidelity harness, per-graph counters). Benchmarks go through this interface, so they
run at any tensor_parallel_size; wrapping `execute` (an instance attribute) times a step's
model part either way.

UniprocExecutor (tensor_parallel_size 1) calls today's ModelRunner directly. MultiprocExecutor
spawns one worker process per rank (worker/tp_worker.py, torch.multiprocessing "spawn"),
sends each command pickled once to every rank, and waits for every rank's reply while
watching the processes: a rank that dies or raises makes the engine raise RuntimeError
within `timeout_s` (at once for a death), and every rank is stopped.
"""
from __future__ import annotations

import os
import pickle
import socket
import time
import weakref
from typing import Any

import numpy as np


def make_executor(cfg, source):
    """The executor for cfg.parallel.tensor_parallel_size."""
    if cfg.parallel.tensor_parallel_size == 1:
        return UniprocExecutor(cfg, source)
    return MultiprocExecutor(cfg, source)


class UniprocExecutor:
    """The model in this process: every call goes straight to the ModelRunner."""

    def __init__(self, cfg, source) -> None:
        from sparseserve.worker.model_runner import ModelRunner
        self.runner = ModelRunner(cfg, source)

    def execute(self, out):
        return self.runner.execute(out)

    def launch(self, out):
        """Async scheduling: run the step without waiting for its tokens -> a handle."""
        return self.runner.launch(out)

    def collect(self, handle):
        """The RunnerOutput of a launched step (waits for its tokens)."""
        return self.runner.collect(handle)

    def release(self, rows, request_ids, pages) -> None:
        self.runner.release(rows, request_ids, pages)

    def offload_stats(self, fresh: bool = True) -> dict | None:
        from sparseserve.worker.tp_worker import offload_stats
        return offload_stats(self.runner, fresh)

    def graph_info(self) -> dict:
        from sparseserve.worker.tp_worker import graph_info
        return graph_info(self.runner)

    def local_runner(self, purpose: str = ""):
        return self.runner

    def check_invariants(self) -> None:
        if self.runner.offload is not None:
            self.runner.offload.check_invariants()

    def check_health(self) -> None:
        if self.runner is None:
            raise RuntimeError("engine has no model runner")

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.offload is not None:
            self.runner.offload.close()  # idempotent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs, conns, grace_s: float = 10.0, term_s: float = 5.0) -> None:
    """Ask every rank to exit, give them grace_s, then terminate (SIGTERM, term_s) and kill
    what is left (idempotent)."""
    msg = pickle.dumps(("shutdown", [], None))
    for c in conns:
        try:
            c.send_bytes(msg)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(term_s)
        if p.is_alive():  # e.g. a stopped (SIGSTOP) process: SIGTERM waits, SIGKILL does not
            p.kill()
            p.join(5.0)
    for c in conns:
        c.close()


class MultiprocExecutor:
    """tensor_parallel_size worker processes, one per rank; the scheduler stays here.

    timeout_s (env SPARSESERVE_TP_TIMEOUT_S, default 600): the longest a step (or startup)
    may take before the engine gives up on the ranks. Broadcast cost is kept in
    `bytes_sent_total` / `send_s_total` (pickling + writing to every pipe) / `num_sent`."""

    def __init__(self, cfg, source, timeout_s: float | None = None) -> None:
        import torch.multiprocessing as mp

        from sparseserve.worker.tp_worker import worker_main

        self.runner = None
        self.size = cfg.parallel.tensor_parallel_size
        self.kv_offload = bool(cfg.cache.kv_offload)
        self.timeout_s = float(timeout_s or os.environ.get("SPARSESERVE_TP_TIMEOUT_S", 600))
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        self.backend = backend
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.procs, self.conns = [], []
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"sparseserve-tp{rank}", daemon=True,
                            args=(rank, self.size, port, backend, self.timeout_s, cfg, source,
                                  child))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        self._dead: str | None = None
        self._pending: list[tuple] = []
        self.bytes_sent_total = 0
        self.send_s_total = 0.0
        self.num_sent = 0
        self._collect("start up")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- commands -------------------------------------------------------------------------
    def execute(self, out):
        replies = self._call("execute", out)
        res = replies[0]
        sets = [r.working_sets for r in replies if r.working_sets is not None]
        if sets:
            res.working_sets = np.maximum.reduce(sets)  # a row's largest share over the ranks
        return res

    def release(self, rows, request_ids, pages) -> None:
        if len(rows) or len(request_ids) or len(pages):
            self._pending.append((rows, request_ids, pages))  # sent with the next command

    def offload_stats(self, fresh: bool = True) -> dict | None:
        if not self.kv_offload:
            return None  # no round trip to the ranks
        replies = self._call("offload_stats", fresh)
        if replies[0] is None:
            return None
        return {k: sum(r[k] for r in replies) for k in replies[0]}

    def graph_info(self) -> dict:
        return self._call("graph_info", None)[0]

    def local_runner(self, purpose: str = ""):
        what = f"{purpose} needs" if purpose else "This needs"
        raise RuntimeError(f"{what} the in-process model runner, but with "
                           f"tensor_parallel_size={self.size} the model lives in {self.size} "
                           "worker processes; run it with tensor_parallel_size=1.")

    def check_invariants(self) -> None:
        self._call("check_invariants", None)

    def check_health(self) -> None:
        if self._dead is None:
            self._check_alive()
        if self._dead is not None:
            raise RuntimeError(self._dead)

    def shutdown(self) -> None:
        self._finalizer()

    # ---- transport ------------------------------------------------------------------------
    def _call(self, cmd: str, arg: Any) -> list[Any]:
        if self._dead is not None:
            raise RuntimeError(self._dead)
        t0 = time.perf_counter()
        msg = pickle.dumps((cmd, self._pending, arg), protocol=pickle.HIGHEST_PROTOCOL)
        self._pending = []
        try:
            for c in self.conns:
                c.send_bytes(msg)
        except (OSError, ValueError):
            self._check_alive()
            self._fail(f"could not send {cmd!r} to the tensor-parallel ranks")
        if cmd == "execute":
            self.send_s_total += time.perf_counter() - t0
            self.bytes_sent_total += len(msg)
            self.num_sent += 1
        return self._collect(cmd)

    def _collect(self, what: str) -> list[Any]:
        from multiprocessing.connection import wait

        replies: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while True:
            for r, c in enumerate(self.conns):  # replies (and error reports) first
                if r in replies or not c.poll():
                    continue
                try:
                    status, payload = c.recv()
                except (EOFError, OSError):
                    continue  # the process is gone: _check_alive reports it
                if status == "error":
                    self._fail(f"tensor-parallel rank {r} failed during {what!r}:\n{payload}")
                replies[r] = payload
            if len(replies) == self.size:
                break
            self._check_alive()
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"the tensor-parallel ranks did not answer {what!r} within "
                           f"{self.timeout_s:.0f} s (SPARSESERVE_TP_TIMEOUT_S); a rank hangs")
            waiting = [c for r, c in enumerate(self.conns) if r not in replies]
            wait(waiting + [p.sentinel for p in self.procs], timeout=min(left, 1.0))
        return [replies[r] for r in range(self.size)]

    def _check_alive(self) -> None:
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                self._fail(f"tensor-parallel rank {r} (pid {p.pid}) died with exit code "
                           f"{p.exitcode}; the engine cannot continue. Restart it (check the "
                           "rank's memory use and log).")

    def _fail(self, message: str) -> None:
        self._dead = message
        # the ranks are broken: a short grace for the live ones, then they are killed
        self._finalizer.detach()
        _stop(self.procs, self.conns, grace_s=2.0, term_s=1.0)
        raise RuntimeError(message)
