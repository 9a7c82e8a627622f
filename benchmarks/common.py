"""Shared helpers for benchmark scripts: environment/GPU description, timing that respects
CUDA's asynchrony, CUDA graph capture, summary statistics, a wall-clock budget, device and
pinned host memory release, JSON results, a text table, matplotlib figures, and the model
selection of the engine benchmarks.

Every benchmark writes one JSON file holding its numbers plus `meta()`: the exact command,
the date, the hardware and the library versions, so a result can be traced to its run.
Nothing here imports sparseserve's engine, so it stays usable from any script.
"""
from __future__ import annotations

import copy
import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- environment ----------------------------------------------------------------------------
def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran this script, shell-quoted, e.g. `python benchmarks/x.py --out d`."""
    argv = list(sys.argv if argv is None else argv)
    return " ".join(shlex.quote(a) for a in ["python", *argv])


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "unknown"))
    except Exception as exc:  # noqa: BLE001 - a missing library is a fact to record
        return f"unavailable ({type(exc).__name__})"


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             cwd=REPO_ROOT, check=False)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def git_info() -> dict[str, Any]:
    commit = _run(["git", "rev-parse", "HEAD"])
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict[str, Any]:
    """Name, memory, compute capability and driver of every visible CUDA device (empty list
    on a CPU-only machine)."""
    import torch

    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(),
                            "torch_cuda": torch.version.cuda, "devices": []}
    if not torch.cuda.is_available():
        return info
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        info["devices"].append({
            "index": i, "name": p.name, "total_memory_gib": round(p.total_memory / 2**30, 2),
            "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
        })
    smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                "--format=csv,noheader"])
    if smi:
        info["nvidia_smi"] = smi.splitlines()
    return info


def meta(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Everything needed to trace a result back to its run."""
    import torch

    gpu = gpu_info()
    return {
        "command": command_line(argv),
        "cwd": os.getcwd(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu_name": gpu["devices"][0]["name"] if gpu["devices"] else None,
        "gpu": gpu,
        "versions": {
            "torch": torch.__version__,
            "triton": _version("triton"),
            "transformers": _version("transformers"),
            "sparseserve": _version("sparseserve"),
            "numpy": _version("numpy"),
        },
        "git": git_info(),
    }


# ---- timing ---------------------------------------------------------------------------------
def synchronize(device: Any = None) -> None:
    """Wait for all queued GPU work (no-op on CPU)."""
    import torch

    dev = None if device is None else torch.device(device)
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        torch.cuda.synchronize()


class Timer:
    """Wall time of a block with the device synchronised on entry and exit, plus GPU time
    from CUDA events when on a GPU.

        with Timer(device) as t: work()
        t.wall_s, t.gpu_s  (gpu_s is None on CPU)
    """

    def __init__(self, device: Any = None) -> None:
        import torch

        self.device = device
        self.cuda = torch.cuda.is_available() and (
            device is None or torch.device(device).type == "cuda")
        self.wall_s = 0.0
        self.gpu_s: float | None = None
        self._events = None

    def __enter__(self) -> "Timer":
        import torch

        synchronize(self.device)
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._events is not None:
            self._events[1].record()
        synchronize(self.device)
        self.wall_s = time.perf_counter() - self._t0
        if self._events is not None:
            self.gpu_s = self._events[0].elapsed_time(self._events[1]) / 1e3


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """n, mean, median, std, min, p10, p90, max of `values` (each multiplied by `scale`)."""
    v = sorted(float(x) * scale for x in values)
    if not v:
        return {"n": 0, "mean": None, "median": None, "std": None, "min": None,
                "p10": None, "p90": None, "max": None}

    def pct(q: float) -> float:
        pos = q * (len(v) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    return {"n": len(v), "mean": statistics.fmean(v), "median": statistics.median(v),
            "std": statistics.pstdev(v) if len(v) > 1 else 0.0, "min": v[0],
            "p10": pct(0.10), "p90": pct(0.90), "max": v[-1]}


class Deadline:
    """A wall-clock budget for a whole script, so a run on a rented machine ends in time."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def expired(self, reserve_s: float = 0.0) -> bool:
        return self.remaining() <= reserve_s


def capture_graph(fn: Any, warmup: int = 2) -> Any:
    """A CUDA graph of fn() (warmed up `warmup` times on a side stream first, as torch
    recommends); replay it with `.replay()`."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


# ---- memory ---------------------------------------------------------------------------------
def free_device_memory() -> dict[str, float] | None:
    """Collect garbage and return cached CUDA blocks; -> memory still in use (GiB), or None on
    a CPU-only machine. Call after `del engine` so the next part starts from an empty GPU."""
    import torch

    gc.collect()
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30,
            "free_gib": free / 2**30, "total_gib": total / 2**30}


def empty_host_cache() -> bool:
    """Return cached pinned host blocks to the OS (they stay pinned after the tensors that
    used them are freed); -> whether it ran (False on a CPU-only machine)."""
    import torch

    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is None or not torch.cuda.is_available():
        return False
    try:
        gc.collect()
        torch.cuda.synchronize()
        fn()
        return True
    except Exception:  # noqa: BLE001
        return False


@contextmanager
def peak_memory(record: dict[str, Any], key: str = "peak_memory_gib"):
    """Store the peak CUDA memory allocated inside the block into record[key]."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        if cuda:
            record[key] = round(torch.cuda.max_memory_allocated() / 2**30, 3)


def is_oom(exc: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError")
    return isinstance(exc, oom) or "out of memory" in str(exc).lower()


def error_record(exc: BaseException) -> dict[str, str]:
    import traceback

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-4000:]}


# ---- output ---------------------------------------------------------------------------------
def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None, numpy/torch scalars -> Python, tuples -> lists."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return _clean(obj.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(obj)


def write_json(path: str, obj: Any) -> str:
    """Write strict JSON atomically (a reader never sees half a file); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(_clean(obj), f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (the GPU machines have no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> str:
    """Lay out, write (120 dpi) and close a figure; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- model selection shared by the engine benchmarks ----------------------------------------
TINY_OVERRIDES = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      vocab_size=2048, bos_token_id=1, eos_token_id=2)


def resolve_model(args, tmpdir: str, max_positions: int) -> tuple[str, dict, str]:
    """--model / --smoke -> (model argument for sparseserve, HF config dict, display name).
    Smoke runs get a 2-layer config derived from llama-3-8b, written to tmpdir."""
    from sparseserve.model.loader.dummy import BUILTIN_DUMMY_CONFIGS, find_builtin

    if args.model is None and args.smoke:
        cfg = {**copy.deepcopy(BUILTIN_DUMMY_CONFIGS["llama-3-8b"]), **TINY_OVERRIDES,
               "max_position_embeddings": max_positions}
        path = os.path.join(tmpdir, "tiny-llama")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        return path, cfg, "tiny-llama (llama-3-8b dict, 2 layers, hidden 256)"
    name = args.model or "llama-3-8b"
    if os.path.isdir(name):
        with open(os.path.join(name, "config.json")) as f:
            return name, json.load(f), os.path.basename(os.path.normpath(name))
    key = find_builtin(name)
    if key is None:
        raise SystemExit(f"--model {name!r}: not a built-in dummy config "
                         f"({sorted(BUILTIN_DUMMY_CONFIGS)}) nor a directory with config.json")
    return key, copy.deepcopy(BUILTIN_DUMMY_CONFIGS[key]), key
