"""Helpers shared by the benchmarks that drive the whole engine (offline_throughput.py,
offload.py): the --only part list and the device choice, the progress log and error records,
random prompts, and what their decode-step timing needs from the engine (the pure-decode
check, the executor's execute wall times, the captured CUDA graph sizes).

Nothing here imports sparseserve; the engine objects are passed in.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import common as C


# ---- arguments ------------------------------------------------------------------------------
def split_list(text: str) -> list[str]:
    """A comma list of names, blanks dropped: "a, b,," -> ["a", "b"]."""
    return [s.strip() for s in text.split(",") if s.strip()]


def add_run_args(p, out_help: str, parts: Sequence[str]) -> None:
    """The arguments every engine benchmark takes: --out, --smoke, --only (of `parts`, all by
    default), --model, --device, --seed."""
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, tiny workloads")
    p.add_argument("--only", default=",".join(parts), help=f"comma list of {', '.join(parts)}")
    p.add_argument("--model", default=None, help="built-in dummy config or HF dir (config only)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present; "
                                                  "cpu with --smoke)")
    p.add_argument("--seed", type=int, default=0)


def parse_parts(text: str, parts: Sequence[str]) -> list[str]:
    """--only: the parts to run, each one of `parts` (SystemExit otherwise)."""
    chosen = split_list(text)
    bad = [s for s in chosen if s not in parts]
    if bad or not chosen:
        raise SystemExit(f"--only: unknown part(s) {bad}; choose from {','.join(parts)}")
    return chosen


def per_config(items: list[str], names: list[str], flag: str, what: str) -> dict[str, str]:
    """`NAME=VALUE` options of one configuration each -> {NAME: VALUE}; SystemExit when NAME is
    not a configuration of this run."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise SystemExit(f"{flag} {item!r}: expected NAME={what} with NAME one of the "
                             f"configurations run ({', '.join(names)})")
        out[name] = value
    return out


def add_workload_args(p) -> None:
    """The serving workload and engine-shape arguments serving.py and serving_http.py share."""
    p.add_argument("--dataset-name", default="longbench", choices=["longbench", "random"])
    p.add_argument("--max-input-len", type=int, default=32768, help="the paper's cap for LWM-7B")
    p.add_argument("--max-model-len", type=int, default=33792)
    p.add_argument("--random-input-len", type=int, default=8192)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument("--kv-cache-gib", type=float, default=20, help="device KV budget (GiB)")
    p.add_argument("--host-gib", type=float, default=72, help="host tier (GiB of pinned DRAM)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--token-budget", type=int, default=2048)


def device_and_dtype(args) -> tuple[str, str]:
    """--device (default: cuda if present, cpu with --smoke) and its dtype (bf16 on cuda)."""
    import torch

    device = args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    return device, "bfloat16" if device == "cuda" else "float32"


# ---- progress and errors --------------------------------------------------------------------
def log(deadline: C.Deadline, msg: str) -> None:
    print(f"[{deadline.elapsed():7.1f}s] {msg}", flush=True)


def fail(deadline: C.Deadline, result: dict, part: str, exc: BaseException) -> dict:
    """Log a failed part and add it to result["errors"]; -> its error record."""
    rec = C.error_record(exc)
    log(deadline, f"  {part} FAILED: {rec['error'][:300]}")
    result["errors"].append({"part": part, **rec})
    return rec


def finish(deadline: C.Deadline, result: dict, save, out_path: str, table) -> None:
    """The end of a run: mark the result complete, write it (`save()`), then print
    `table(result)` last."""
    result["complete"] = True
    save()
    log(deadline, f"wrote {out_path}")
    print("\n" + table(result), flush=True)


def errors_line(errors: list[dict]) -> str:
    """The last line of a summary table: every error, shortened."""
    return "errors: " + "; ".join(f"{e['part']}: {e['error'][:120]}" for e in errors)


# ---- engine steps ---------------------------------------------------------------------------
def prompt_ids(rng: Any, n: int, vocab: int) -> list[int]:
    """n random token ids (numpy Generator `rng`)."""
    return rng.integers(0, vocab, n).tolist()


def pure_decode(sched, batch: int) -> bool | None:
    """Every one of `batch` running requests decodes one token this step (none waiting, none
    prefilling a chunk or a layer segment); None if the scheduler changed shape and this
    cannot be verified."""
    try:
        return (not sched.waiting and len(sched.running) == batch and all(
            r.num_tokens - r.num_computed_tokens == 1 and getattr(r, "prefill_layer", 0) == 0
            for r in sched.running))
    except AttributeError:
        return None


class ExecuteTimer:
    """Wall time of each execute call of `runner` (the engine's executor: the model part of
    a step at any tensor_parallel_size) while installed: an instance attribute that shadows
    the method, so removing it restores the object exactly."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.times: list[float] = []
        self._original = runner.execute

    def _timed(self, out):
        t = time.perf_counter()
        r = self._original(out)
        self.times.append(time.perf_counter() - t)
        return r

    def install(self) -> None:
        self.runner.execute = self._timed

    def remove(self) -> None:
        self.runner.__dict__.pop("execute", None)


def engine_graph_sizes(engine) -> list[int] | None:
    """Batch sizes of the decode CUDA graphs the engine's (rank 0's) runner captured (None:
    eager); through the executor, so at any tensor_parallel_size."""
    return engine.executor.graph_info()["batch_sizes"]
