"""One tensor-parallel rank: a worker process that the engine's MultiprocExecutor spawns.

`worker_main` joins the torch.distributed group (gloo on CPU, NCCL on CUDA), builds this
rank's `RankRunner` (its weight shard, its num_key_value_heads / size KV heads' pages, host
tier share, device cache, summaries and transfers) and serves the engine's commands from
its pipe until "shutdown" or until the engine goes away.

Wire protocol (pipe, pickled): engine -> rank `(command, releases, argument)` as one bytes
message, the same bytes for every rank; `releases` are the (rows, request ids, pages) the
engine released since the last command, applied first. rank -> engine `("ok", reply)` or
`("error", traceback text)` (after which the rank exits). Commands: "execute"
(SchedulerOutput -> RunnerOutput: tokens and logprobs from rank 0 only, working sets from
every rank), "offload_stats" (-> dict | None), "graph_info" (-> dict), "check_invariants",
"shutdown".
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
import traceback

from sparseserve.engine.gc_pauses import freeze_startup_heap
from sparseserve.worker.model_runner import ModelRunner, RunnerOutput


class RankRunner(ModelRunner):
    """A ModelRunner for one rank. Rank 0 samples from the gathered logits as usual; the
    other ranks run the same forward pass (their shards, their KV heads) and return only
    their working sets (the engine takes the per-row maximum over ranks)."""

    def _sample(self, chunks, logits, t0) -> RunnerOutput:
        if self.tp.rank == 0:
            return super()._sample(chunks, logits, t0)
        result = RunnerOutput()
        if self.offload is not None:
            self.offload.count_working_sets()
        result.host_time_s = time.perf_counter() - t0
        if self.offload is not None:
            result.working_sets = self.offload.working_sets()
        return result


def offload_stats(runner: ModelRunner, fresh: bool = True) -> dict | None:
    """The two-tier cache's counters plus its size in slots x layers (None without it);
    fresh=False: without waiting for the device (TwoTierCache.stats)."""
    off = runner.offload
    if off is None:
        return None
    stats = dict(off.stats(fresh))
    stats["total_slots"] = off.num_slots * off.num_layers
    return stats


def graph_info(runner: ModelRunner) -> dict:
    """The batch sizes of the decode CUDA graphs the runner captured (None: it decodes
    eagerly) and why capture failed, if it did."""
    graphs = runner.graphs
    sizes = list(getattr(graphs, "sizes", None) or []) if graphs is not None else None
    return {"batch_sizes": sizes, "error": runner.graph_error}


def _serve(runner: ModelRunner, cmd: str, arg):
    if cmd == "execute":
        return runner.execute(arg)
    if cmd == "offload_stats":
        return offload_stats(runner, True if arg is None else bool(arg))
    if cmd == "graph_info":
        return graph_info(runner)
    if cmd == "check_invariants":
        if runner.offload is not None:
            runner.offload.check_invariants()
        return None
    raise ValueError(f"unknown worker command {cmd!r}")


def worker_main(rank: int, size: int, port: int, backend: str, timeout_s: float,
                cfg, source, conn) -> None:
    """Process entry of rank `rank` of `size` (see the module docstring for the protocol);
    ends the process (os._exit: 0, or 1 after an error) once the rank is cleaned up."""
    import torch
    import torch.distributed as dist

    from sparseserve.model.parallel import TensorParallel

    runner, code = None, 0
    try:
        if cfg.device == "cuda":
            torch.cuda.set_device(rank)
        else:  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
        runner = RankRunner(cfg, source, TensorParallel(rank, size))
        freeze_startup_heap()  # as the engine's process does (engine/gc_pauses.py)
        conn.send(("ok", None))
        while True:
            try:
                cmd, releases, arg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # the engine is gone
            if cmd == "shutdown":
                break
            for rel in releases:
                runner.release(*rel)
            conn.send(("ok", _serve(runner, cmd, arg)))
    except BaseException:  # noqa: BLE001 - the engine reports it and stops every rank
        code = 1
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, EOFError):
            pass
    finally:
        try:
            if runner is not None and runner.offload is not None:
                runner.offload.close()
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001 - nobody is left to tell but the log
            code = code or 1
            traceback.print_exc()
        # nothing is left to do: skip the interpreter's teardown, over a second with torch
        # loaded (a shutdown then takes as long as the ranks' cleanup above)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
