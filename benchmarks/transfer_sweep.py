"""The page-size sweep of benchmarks/transfer.py (class Sweep): for one page size, every
load and save method at every page count, timed and recorded as a row (or as skipped: per-page
copies above --per-page-max or past the time budget), each method checked bit-exact once, and
the FlashH2D extras on the first large page size; all into the result dict."""
from __future__ import annotations

import common as C
import numpy as np
import torch

from sparseserve.transfer import (FlashD2HSaver, PerPageCopySaver, load_pages,
                                  memcpy_load_pages)
from transfer_clock import Clock
from transfer_flash_h2d import graph_check, h2d_tuning
from transfer_pages import (PageSizeRun, check_load, check_save, gpu_direct_fn, saver_call,
                            scatter_extra)


class Sweep:
    """The measurements of every page size, recorded into the result dict `res`."""

    def __init__(self, args, dev, clock: Clock, deadline: C.Deadline, res: dict, rng) -> None:
        self.args, self.dev, self.clock, self.deadline, self.res, self.rng = \
            args, dev, clock, deadline, res, rng
        self.cuda = dev.type == "cuda"
        self.max_pages = max(args.pages)

    def record(self, direction, method, r, n, fn_or_none, nbytes, reason=None, extra=None):
        """One row: fn_or_none timed (None: skipped for `reason`); `extra()` adds fields."""
        res, args, clock = self.res, self.args, self.clock
        row = {"direction": direction, "method": method, "page_kb": r.page_kb,
               "page_bytes": r.page_bytes, "page_size": r.ps, "head_dim": r.D, "pages": n,
               "bytes": nbytes}
        if fn_or_none is None:
            row.update(status="skipped", reason=reason)
            res["skipped"].append(f"{direction} {method} {r.page_kb:g} KB x {n}: {reason}")
        else:
            try:
                t = clock.run(fn_or_none, args.reps, args.warmup)
                med = float(np.median(t))
                row.update(status="ok", ms=med * 1e3, times_ms=[x * 1e3 for x in t],
                           gbps=nbytes / med / 1e9)
                if extra:
                    row.update(extra())
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", **C.error_record(exc))
                print(f"  {direction} {method} {r.page_kb:g}KB x{n}: ERROR {exc}", flush=True)
                if C.is_oom(exc):
                    C.free_device_memory()
        res["rows"].append(row)
        if row.get("status") == "ok":
            print(f"  {direction:4s} {method:16s} {r.page_kb:6g} KB x {n:6d}: "
                  f"{row['gbps']:7.2f} GB/s ({row['ms']:.3f} ms)", flush=True)

    def check(self, direction, method, r, n, fn):
        """One exactness check: fn() -> whether the copy was bit-exact."""
        res = self.res
        try:
            ok = bool(fn())
            res["checks"].append({"direction": direction, "method": method, "page_kb": r.page_kb,
                                  "pages": n, "exact": ok})
            if not ok:
                print(f"  CHECK FAILED: {direction} {method} {r.page_kb:g} KB x {n}", flush=True)
        except Exception as exc:  # noqa: BLE001
            res["checks"].append({"direction": direction, "method": method, "page_kb": r.page_kb,
                                  "pages": n, "exact": False, **C.error_record(exc)})
            print(f"  CHECK ERROR: {direction} {method}: {exc}", flush=True)

    def per_page_reason(self, n):
        """Why per-page copies of n pages are skipped (None: they run)."""
        args, deadline = self.args, self.deadline
        if n > args.per_page_max:
            return f"per-page copies capped at {args.per_page_max} pages (--per-page-max)"
        if deadline.expired(reserve_s=0.35 * args.budget_s):
            return "time budget"
        return None

    def one_page_size(self, kb):
        """Every measurement of one page size; -> its savers (closed by the caller)."""
        res, args, clock, dev, cuda = self.res, self.args, self.clock, self.dev, self.cuda
        max_pages, record, check = self.max_pages, self.record, self.check
        per_page_reason = self.per_page_reason
        print(f"page {kb:g} KB", flush=True)
        try:
            r = PageSizeRun(args, dev, kb, max_pages, self.rng)
        except Exception as exc:  # noqa: BLE001
            res["skipped"].append(f"page size {kb:g} KB: setup failed: {exc}")
            print("  setup failed:", exc, flush=True)
            C.free_device_memory()
            return
        n_chk = min(256, max_pages)
        staging = args.staging_mib << 20
        savers = {}
        try:
            for t in args.d2h_threads:
                savers[f"flash-d2h-t{t}"] = FlashD2HSaver([r.host_k], [r.host_v], num_threads=t,
                                                          staging_bytes=staging)
            savers["per-page-copy"] = PerPageCopySaver([r.host_k], [r.host_v])
        except Exception as exc:  # noqa: BLE001
            res["skipped"].append(f"savers for {kb:g} KB: {exc}")
        # ---- load
        check("load", "flash-h2d", r, n_chk, lambda: check_load(r, "flash", n_chk))
        check("load", "per-page-copy", r, n_chk, lambda: check_load(r, "memcpy", n_chk))
        for n in args.pages:
            src, dst = r.load_ids(n)
            s_t, d_t = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
            nbytes = 2 * n * r.page_bytes
            record("load", "flash-h2d", r, n, lambda: load_pages(
                r.host_k, r.host_v, r.dev_k, r.dev_v, s_t, d_t, "flash"), nbytes)
            # same pages in host order (consecutive ids): is page scatter the cost?
            s_seq = torch.arange(n, device=dev)
            record("load", "flash-h2d-seq", r, n, lambda: load_pages(
                r.host_k, r.host_v, r.dev_k, r.dev_v, s_seq, d_t, "flash"), nbytes)
            # one contiguous copy of the same bytes: the bulk bandwidth at this size
            if cuda:
                flat_h, flat_d = r.host_k.view(-1)[:nbytes // 4], r.dev_k.view(-1)[:nbytes // 4]
                record("load", "bulk-same-bytes", r, n, lambda: (
                    flat_d.copy_(flat_h, non_blocking=True),
                    r.dev_v.view(-1)[:nbytes // 4].copy_(r.host_v.view(-1)[:nbytes // 4],
                                                         non_blocking=True)), nbytes)
            why = per_page_reason(n)
            sl, dl = src.tolist(), dst.tolist()
            record("load", "per-page-copy", r, n, None if why else lambda: memcpy_load_pages(
                r.host_k, r.host_v, r.dev_k, r.dev_v, sl, dl), nbytes, reason=why)
        if cuda and not args.smoke and not res["graph"] and kb >= 16:
            try:
                res["graph"].append(graph_check(r, min(1024, max_pages), clock, args.reps))
                print(f"  cuda graph: {res['graph'][-1]}", flush=True)
            except Exception as exc:  # noqa: BLE001
                res["graph"].append({"page_kb": kb, **C.error_record(exc)})
                print("  cuda graph check failed:", exc, flush=True)
            res["h2d_tuning"] = h2d_tuning(r, min(4096, max_pages), clock, args.reps)
        # ---- save
        gd = gpu_direct_fn(r)
        check("save", "gpu-direct", r, n_chk, lambda: check_save(r, lambda T, p, o: gd(T, p, o)(), n_chk))
        for name, sv in savers.items():
            check("save", name, r, n_chk, lambda sv=sv: check_save(
                r, lambda T, p, o: saver_call(sv, r, T, p, o)(), n_chk))
            check("save", name + "-chunked", r, n_chk, lambda sv=sv: check_save(
                r, lambda T, p, o: saver_call(sv, r, T, p, o)(), n_chk, chunked=True))
        for n in args.pages:
            T, pages, offs = r.save_layout(n)
            nbytes = 2 * pages.size * r.D * 2                # rows x D x bf16, K and V
            record("save", "gpu-direct", r, n, gd(T, pages, offs), nbytes)
            # FlashD2H also with the engine's page layout (chunks of consecutive host pages)
            Tc, pages_c, offs_c = r.save_layout(n, chunked=True)
            for name, sv in savers.items():
                why = per_page_reason(n) if name == "per-page-copy" else None
                layouts = [(name, T, pages, offs)]
                if name.startswith("flash-d2h"):
                    layouts.append((name + "-chunked", Tc, pages_c, offs_c))
                for label, t_, p_, o_ in layouts:
                    record("save", label, r, n, None if why else saver_call(sv, r, t_, p_, o_),
                           nbytes, reason=why, extra=scatter_extra(sv) if label != name
                           or name.startswith("flash-d2h") else None)
        return savers
