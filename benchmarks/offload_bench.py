"""The state benchmarks/offload.py's runs share (class Bench): settings, the result dict and
its file, the wall-clock budget with the time estimates that decide what still fits, the
engine arguments every run starts from, and the pinned host memory budget."""
from __future__ import annotations

import common as C
import engine_bench as E
from offload_shape import GiB, Shape, meminfo


class Bench:
    """State shared by the runs: settings, the result dict, the deadline, estimates."""

    def __init__(self, args, model: str, cfg: dict, device: str, dtype: str,
                 deadline: C.Deadline, result: dict, out_path: str) -> None:
        self.args, self.model, self.cfg = args, model, cfg
        self.device, self.dtype = device, dtype
        self.deadline, self.result, self.out_path = deadline, result, out_path
        self.shape = Shape(cfg, 2 if dtype in ("bfloat16", "float16") else 4, args.page_size)
        self.vocab = int(cfg["vocab_size"])
        # time estimates (generous until measured) for skipping what would not fit
        self.loads: list[float] = []
        self.sec_per_token = 2e-3 if device == "cpu" else 1e-4  # prefill, 32k-token prompt
        self.step_estimate_s = 0.5 if device == "cpu" else 0.25  # one decode step
        self.measured_steps = False
        self.pinned_cache: dict[int, int] = {}  # pinned block layouts freed engines left cached
        mi = meminfo()
        total = mi.get("MemTotal", 0)
        avail = mi.get("MemAvailable", total)
        keep = max(2 * GiB, min(16 * GiB, int(0.15 * total)))  # for the OS and this process
        self.host_limit = args.host_mem_limit_gib * GiB if args.host_mem_limit_gib else \
            max(0, min(int(0.65 * total), avail - keep))

    @property
    def load_s(self) -> float:
        """Engine construction estimate: the slowest of the last three (graph capture varies;
        the first one also pays CUDA and cuBLAS initialisation)."""
        if self.loads:
            return max(self.loads[-3:]) + 1.0
        return 6.0 if self.device == "cpu" else 25.0

    def save(self) -> None:
        self.result["elapsed_s"] = self.deadline.elapsed()
        C.write_json(self.out_path, self.result)

    def fail(self, part: str, exc: BaseException) -> dict:
        return E.fail(self.deadline, self.result, part, exc)

    def skip(self, part: str, reason: str) -> None:
        E.log(self.deadline, f"  skipping {part}: {reason}")
        self.result["skipped"].append({"part": part, "reason": reason})

    def fits(self, part: str, estimate_s: float) -> bool:
        left = self.deadline.remaining() - self.args.reserve_s
        if estimate_s > left:
            self.skip(part, f"time budget: needs ~{estimate_s:.0f} s, {max(left, 0):.0f} s left")
            return False
        return True

    def base_kwargs(self) -> dict:
        a = self.args
        return dict(load_format="dummy", dtype=self.dtype, device=self.device, seed=a.seed,
                    page_size=a.page_size)

    def sparse_kwargs(self) -> dict:
        a = self.args
        return dict(sparse_algorithm=a.sparse_algorithm, token_budget=a.token_budget,
                    sink_pages=a.sink_pages, local_pages=a.local_pages)

    def prepare_pinned(self, part: str, num_ids: int) -> dict | None:
        """Host memory check before an offload engine; frees cached pinned blocks of another
        layout if the two would not fit together. -> record, or None to skip the run."""
        need = self.shape.pinned_bytes(num_ids)
        rec = {"host_pages": num_ids, "requested_gib": num_ids * self.shape.page_bytes / GiB,
               "pinned_gib": need / GiB}
        cached_other = sum(b for k, b in self.pinned_cache.items() if k != need)
        if self.pinned_cache and cached_other + need > self.host_limit:
            rec["emptied_host_cache"] = C.empty_host_cache()
            self.pinned_cache.clear()
        if need > self.host_limit:
            self.skip(part, f"host memory: the host tier pins {need / GiB:.1f} GiB, limit "
                            f"{self.host_limit / GiB:.1f} GiB (--host-mem-limit-gib)")
            return None
        self.pinned_cache[need] = need
        return rec
