"""Sparse decode attention per layer vs dense paged decode (DESIGN.md §4, issue 3 "Benchmark").

Llama-3-8B layer shapes (32 query / 8 KV heads, head_dim 128), bf16, page 32, contexts 8k /
32k / 128k, batch 1 / 4 / 16 / 64, token budget 2048 (64 pages; sink 1, local 2 pages). One
layer's K/V pool holds every request's pages in a random physical order (fragmentation). Per
(context, batch), CUDA events, median over reps after warm-up, L2 flushed before every rep:

* dense:  ``paged_decode_attention`` over all pages;
* select: the algorithm's ``select`` (for arkvale and quest the fused Triton kernel
  ``kernels.select_pages``: per-head bounds, mass scores, kept pages and top-k in one kernel,
  or two launches in split mode); attend:
  ``paged_decode_attention`` over the selection; their sum; and select + attend captured together
  in one CUDA graph;
* fused: ``kernels.select_pages`` called directly with the run's kernel backend (so ``--smoke``
  runs the Triton kernel in the interpreter; on the GPU it is ``select`` minus the wrapper);
* select_unfused: the generic ``SparseAlgorithm.select`` (per-head score kernel + torch mass
  normalisation + ~25 torch ops + topk), the path the fused kernel replaces, and its breakdown:
  the score (``alg.score``: kernel + mass) alone,
  ``torch.topk`` alone (sorted / unsorted), the rest (``select_glue_us``);
* bytes each reads (dense: all K/V; attend: the selected pages' K/V; select: summaries + page
  table) -> TB/s and its fraction of a device-to-device copy measured in the same run
  (``copy_`` of a 2 GiB buffer, read + write bytes); summary bytes / KV bytes.

Two timings per operation. ``*_us``: device time (a spin kernel holds the GPU while the CPU
queues the work, so launch overhead is hidden); bandwidths and ratios use it.
``*_latency_us``: starts on an idle GPU, so it includes the CPU launch cost (what an eager
engine pays when launches are the bottleneck). ``graph_us`` / ``graph_latency_us``: the same
two for one replay of the captured select + attend.

Targets (reported, not asserted): at 128k, select + attend <= dense / 10 (``ratio`` =
(select_us + attend_us) / dense_us; ``ratio_graph`` = graph_us / dense_us); attend >= 60% of
the copy bandwidth on its bytes; summaries <= 4% of KV bytes.

``--max-kv-gb`` (100) limits the one-layer K+V pool the run allocates (128k x 64 is 34 GB, so
nothing is skipped by default); ``--max-kv-scope model`` applies it to all 32 layers instead.
Combos that do not fit in free memory, or past ``--budget-s`` (270 s), are skipped and listed.

    python benchmarks/sparse_decode.py --out DIR          # H200, about 1-2 minutes
    python benchmarks/sparse_decode.py --smoke --out DIR  # CPU, Triton interpreter

Writes DIR/sparse_decode.json (rows, command, GPU, versions, date) and DIR/sparse_decode.png;
prints the select analysis, then a table last. Exit status 1 if any measurement failed.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

FULL = dict(device="cuda", dtype="bfloat16", num_q_heads=32, num_kv_heads=8, head_dim=128,
            page_size=32, num_layers=32, contexts=[8192, 32768, 131072], batches=[1, 4, 16, 64],
            token_budget=2048, sink_pages=1, local_pages=2, warmup=3, min_reps=10, max_reps=50,
            target_s=0.2, copy_mib=2048, flush_mib=256, spin_cycles=2_000_000)
# fp32 in --smoke: Triton 3.6's interpreter computes tl.dot on bf16 operands wrongly (~1e10)
SMOKE = dict(FULL, device="cpu", dtype="float32", num_q_heads=4, num_kv_heads=2, head_dim=16,
             contexts=[256, 512], batches=[1, 2], token_budget=128, warmup=1, min_reps=2,
             max_reps=2, target_s=0.0, copy_mib=16, flush_mib=0, spin_cycles=0)
INDEX_CHUNK = 1 << 18  # pages per index() call while building summaries
TARGETS = {"ratio_max": 0.10, "attend_bw_frac_min": 0.60, "summary_frac_max": 0.04}


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="directory for sparse_decode.json and sparse_decode.png")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    p.add_argument("--contexts", type=ints, help="comma-separated context lengths in tokens")
    p.add_argument("--batches", type=ints, help="comma-separated batch sizes")
    p.add_argument("--algorithms", default="arkvale,quest")
    p.add_argument("--max-kv-gb", type=float, default=100.0,
                   help="skip (context, batch) whose dense K+V exceeds this many GB")
    p.add_argument("--max-kv-scope", choices=("layer", "model"), default="layer",
                   help="what --max-kv-gb limits: the one layer this benchmark allocates "
                        "(default), or all num_layers layers of the model")
    p.add_argument("--budget-s", type=float, default=270.0, help="wall-clock budget of the run")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph measurements")
    return p.parse_args(argv)


class Bench:
    """Timings of a callable: device time and idle-start latency (us), median of reps."""

    def __init__(self, torch, C, s, device):
        self.torch, self.C, self.s = torch, C, s
        self.cuda = device.type == "cuda"
        self.flush = (torch.empty(s["flush_mib"] << 20, dtype=torch.uint8, device=device)
                      if self.cuda and s["flush_mib"] else None)
        self.spin = getattr(torch.cuda, "_sleep", None) if self.cuda else None

    def time(self, fn, latency=True):
        torch, s, C = self.torch, self.s, self.C
        for _ in range(s["warmup"]):
            fn()
        if not self.cuda:  # CPU: wall time; both modes are the same thing
            ts = []
            for _ in range(s["min_reps"]):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            st = C.summarize(ts, 1e6)
            return {"gpu": st, "latency": st if latency else None, "reps": len(ts)}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est = time.perf_counter() - t0
        reps = int(min(s["max_reps"], max(s["min_reps"], s["target_s"] / (est + 2e-3))))
        res = {"reps": reps, "latency": None}
        for mode in ("gpu", "latency") if latency else ("gpu",):
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(reps)]
            for a, b in evs:
                torch.cuda.synchronize()
                if mode == "gpu" and self.spin is not None:
                    self.spin(s["spin_cycles"])  # the CPU queues everything below meanwhile
                if self.flush is not None:
                    self.flush.zero_()
                if mode == "latency":
                    torch.cuda.synchronize()
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            res[mode] = C.summarize([a.elapsed_time(b) for a, b in evs], 1e3)
        return res


def capture(torch, fn):
    """A CUDA graph of fn() (warmed up on a side stream first, as torch recommends)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def tbs(nbytes, us):
    return nbytes / (us * 1e-6) / 1e12 if us and us > 0 else None


def frac(x, ref):
    return x / ref if x is not None and ref else None


def kv_bytes(s, ctx, batch, es):
    return batch * s["num_kv_heads"] * ctx * s["head_dim"] * 2 * es


def measure_copy(torch, bench, s, device):
    bufs = torch.ones(2, (s["copy_mib"] << 20) // 2, dtype=torch.bfloat16, device=device)
    t = bench.time(lambda: bufs[1].copy_(bufs[0]), latency=False)
    nbytes = 2 * bufs[0].numel() * bufs.element_size()  # read + write
    us = t["gpu"]["median"]
    return {"buffer_bytes": nbytes // 2, "bytes_moved": nbytes, "us": us, "bw_tbs": tbs(nbytes, us),
            "stats": t["gpu"], "note": "torch copy_ D2D; bandwidth counts read + write bytes"}


def build_pool(torch, s, device, dtype, ctx, bmax, names):
    """K/V pages of bmax requests in random physical order, and each algorithm's summaries."""
    from sparseserve.sparse import LayerSummaries, get_algorithm_class

    ps, hkv, d = s["page_size"], s["num_kv_heads"], s["head_dim"]
    n = -(-ctx // ps)
    last = ctx - (n - 1) * ps
    P = bmax * hkv * n
    k = torch.empty(P, ps, d, dtype=dtype, device=device).normal_()
    v = torch.empty(P, ps, d, dtype=dtype, device=device).normal_()
    table = torch.randperm(P, device=device).to(torch.int32).view(bmax, hkv, n)
    ntok = torch.full((P,), ps, dtype=torch.int32, device=device)
    ntok[table[:, :, -1].reshape(-1).long()] = last
    ids = torch.arange(P, dtype=torch.int32, device=device)
    algs = {}
    for name in names:
        alg = get_algorithm_class(name)(ps, s["token_budget"] // ps, s["sink_pages"],
                                        s["local_pages"])
        summ = LayerSummaries({nm: torch.zeros(P + 1, d, dtype=dtype, device=device)
                               for nm in alg.summary_names})
        for i in range(0, P, INDEX_CHUNK):
            alg.index(k, ids[i:i + INDEX_CHUNK], ntok[i:i + INDEX_CHUNK], summ, None)
        scratch = sum(t.numel() * t.element_size() for t in alg.scratch.values())
        alg.scratch.clear()  # index-time scratch only (ArkVale's radius); not needed to select
        algs[name] = (alg, summ, scratch)
    return dict(k=k, v=v, table=table, n=n, last=last, algs=algs)


def measure_combo(torch, bench, s, pool, ctx, batch, copy_bw, backend, graphs):
    from sparseserve.kernels import paged_decode_attention, ref, select_pages
    from sparseserve.sparse import SparseAlgorithm

    hq, hkv, d, ps = s["num_q_heads"], s["num_kv_heads"], s["head_dim"], s["page_size"]
    k, v, n, last = pool["k"], pool["v"], pool["n"], pool["last"]
    dev, es = k.device, k.element_size()
    pt = pool["table"][:batch]
    npg = torch.full((batch, hkv), n, dtype=torch.int32, device=dev)
    lpl = torch.full((batch,), last, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, device=dev).to(k.dtype)
    scale = d ** -0.5
    attend = lambda sel: paged_decode_attention(  # noqa: E731
        q, k, v, sel.page_table, sel.num_pages, sel.last_page_len, scale, backend=backend)
    dense = lambda: paged_decode_attention(q, k, v, pt, npg, lpl, scale, backend=backend)  # noqa
    base = dict(context=ctx, batch=batch, pages_per_head=n, page_size=ps)
    t = bench.time(dense)
    dense_bytes = kv_bytes(s, ctx, batch, es)
    dense_us = t["gpu"]["median"]
    checks = {}
    if batch * ctx <= 131072:  # torch reference over everything: keep it small
        b = min(batch, 2)
        want = ref.paged_decode_attention(q[:b], k, v, pt[:b], npg[:b], lpl[:b], scale)
        checks["dense_max_abs_err"] = (dense()[:b].float() - want.float()).abs().max().item()
        checks["ok"] = checks["dense_max_abs_err"] < (1e-3 if k.dtype == torch.float32 else 5e-2)
    rows = [dict(base, algorithm="dense", dense_us=dense_us, dense_latency_us=t["latency"]["median"],
                 bytes_read=dense_bytes, bw_tbs=tbs(dense_bytes, dense_us),
                 bw_frac_copy=frac(tbs(dense_bytes, dense_us), copy_bw),
                 kv_gb_full_model=dense_bytes * s["num_layers"] / 1e9,
                 stats=t["gpu"], reps=t["reps"], checks=checks)]
    kv_pool_bytes = 2 * k.numel() * es
    for name, (alg, summ, scratch) in pool["algs"].items():
        select = lambda: alg.select(q, pt, npg, lpl, summ, k)  # noqa: E731
        sel = select()
        sparse = lambda: attend(select())  # noqa: E731
        scores = alg.score(q, pt, npg, lpl, summ, k)
        kk = max(1, min(alg.budget_pages - 1, n))  # the top-k select takes
        # the generic path (what select was before the fused kernel), for the comparison
        unfused = lambda: SparseAlgorithm.select(alg, q, pt, npg, lpl, summ, k)  # noqa: E731
        box = "kmin" in summ.tensors and "kmax" in summ.tensors
        fused = lambda: select_pages(  # noqa: E731
            q, summ["kmin"], summ["kmax"], pt, npg, lpl, alg.budget_pages, alg.sink_pages,
            alg.local_pages, backend=backend)
        r = dict(base, algorithm=name, fused_select=bool(
            getattr(alg, "fused_select", False) and type(alg).select is not SparseAlgorithm.select))
        tm = {"select": bench.time(select), "attend": bench.time(lambda: attend(sel)),
              "sparse": bench.time(sparse), "select_unfused": bench.time(unfused),
              "score": bench.time(lambda: alg.score(q, pt, npg, lpl, summ, k), latency=False),
              "topk": bench.time(lambda: scores.topk(kk, dim=-1), latency=False),
              "topk_unsorted": bench.time(lambda: scores.topk(kk, dim=-1, sorted=False),
                                          latency=False)}
        if box:
            tm["fused"] = bench.time(fused)
        for key, val in tm.items():
            r[f"{key}_us"] = val["gpu"]["median"]
            if val["latency"] is not None:
                r[f"{key}_latency_us"] = val["latency"]["median"]
        r["stats"] = {key: val["gpu"] for key, val in tm.items()}
        r["graph_us"] = r["graph_latency_us"] = r["graph_error"] = None
        if graphs and bench.cuda:
            try:
                g = capture(torch, sparse)
                tg = bench.time(g.replay)
                r.update(graph_us=tg["gpu"]["median"], graph_latency_us=tg["latency"]["median"])
                r["stats"]["graph"] = tg["gpu"]
                del g
            except Exception as exc:  # noqa: BLE001 - recorded; the eager rows still stand
                r["graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"graph capture failed ({name}): {r['graph_error']}", file=sys.stderr)
        elif not bench.cuda:
            r["graph_error"] = "skipped: CUDA graphs need a GPU"
        sel_pages = sel.num_pages.long()
        attend_bytes = int(sel_pages.sum()) * ps * d * 2 * es
        summ_bytes_read = batch * hkv * n * len(summ.tensors) * d * es
        select_bytes = summ_bytes_read + pt.numel() * pt.element_size()
        summ_total = sum(x.numel() * x.element_size() for x in summ.tensors.values())
        r["select_plus_attend_us"] = r["select_us"] + r["attend_us"]
        r["dense_us"] = dense_us
        r["ratio"] = r["select_plus_attend_us"] / dense_us
        r["ratio_graph"] = r["graph_us"] / dense_us if r["graph_us"] else None
        r["ratio_latency"] = r["sparse_latency_us"] / rows[0]["dense_latency_us"]
        r.update(attend_bytes=attend_bytes, select_bytes=select_bytes,
                 select_over_attend_bytes=select_bytes / attend_bytes,
                 attend_bw_tbs=tbs(attend_bytes, r["attend_us"]),
                 select_bw_tbs=tbs(select_bytes, r["select_us"]),
                 score_bw_tbs=tbs(select_bytes + scores.numel() * 4, r["score_us"]))
        for key in ("attend", "select", "score"):
            r[f"{key}_bw_frac_copy"] = frac(r[f"{key}_bw_tbs"], copy_bw)
        r.setdefault("fused_us", None)
        r["select_glue_us"] = r["select_unfused_us"] - r["score_us"] - r["topk_us"]
        r["select_speedup"] = r["select_unfused_us"] / r["select_us"]
        r["select_share"] = r["select_us"] / r["select_plus_attend_us"]
        r.update(summary_bytes=summ_total, kv_pool_bytes=kv_pool_bytes,
                 summary_frac=summ_total / kv_pool_bytes, index_scratch_bytes=scratch,
                 selected_pages=[int(sel_pages.min()), int(sel_pages.max())],
                 topk_k=kk, reps={key: val["reps"] for key, val in tm.items()})
        b = min(batch, 2)
        sb = sel.page_table[:b], sel.num_pages[:b], sel.last_page_len[:b]
        want = ref.paged_decode_attention(q[:b], k, v, *sb, scale)
        ck = {"attend_max_abs_err": (attend(sel)[:b].float() - want.float()).abs().max().item()}
        if "kmin" in summ.tensors and "kmax" in summ.tensors:
            # Quest/ArkVale score by estimated mass (in [0, G]; +inf kept / last, -inf past n)
            sref = ref.page_mass(q[:b], summ["kmin"], summ["kmax"], pt[:b], npg[:b],
                                 alg.sink_pages, alg.local_pages)
            fin = torch.isfinite(sref)
            ck["score_max_rel_err"] = ((scores[:b] - sref)[fin].abs().max()
                                       / sref[fin].abs().max().clamp(min=1e-6)).item()
        ck["ok"] = all(val < (1e-3 if k.dtype == torch.float32 else 5e-2) for val in ck.values())
        # fused vs generic selection: the same set up to near-ties (scores differ by rounding)
        ck["select_set_mismatch_frac"] = _set_mismatch(torch, sel, unfused(), b, n)
        if box:
            got = fused()
            ck["fused_set_mismatch_frac"] = _set_mismatch(
                torch, type(sel)(got[0], got[1], lpl, got[2]), unfused(), b, n)
        r["checks"] = ck
        r["meets"] = {"ratio": r["ratio"] <= TARGETS["ratio_max"],
                      "attend_bw": (r["attend_bw_frac_copy"] or 0) >= TARGETS["attend_bw_frac_min"],
                      "summary": r["summary_frac"] <= TARGETS["summary_frac_max"]}
        rows.append(r)
    return rows


def _set_mismatch(torch, a, b, rows, W):
    """Fraction of selected entries of a's first ``rows`` requests missing from b's."""
    def onehot(sel):
        blk = sel.blocks[:rows].long()
        m = sel.num_pages[:rows].long().unsqueeze(-1)
        ok = (torch.arange(blk.shape[2], device=blk.device).view(1, 1, -1) < m).float()
        z = torch.zeros(*blk.shape[:2], W + 1, device=blk.device)
        return z.scatter_add_(2, torch.where(ok > 0, blk.clamp(0, W - 1), W), ok)[..., :W]
    ha, hb = onehot(a), onehot(b)
    return 1.0 - float((ha.clamp(max=1) * hb.clamp(max=1)).sum() / ha.sum().clamp(min=1))


def label(ctx):
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def analyse(rows):
    """Where select's time goes at the largest context, and what that suggests."""
    sp = [r for r in rows if r["algorithm"] != "dense"]
    if not sp:
        return {"lines": [], "suggestions": []}
    top = max(r["context"] for r in sp)
    lines, sugg = [], []
    at = sorted((r for r in sp if r["context"] == top), key=lambda r: (r["batch"], r["algorithm"]))
    for r in at:
        r = dict(r, select_unfused_us=r.get("select_unfused_us", r["select_us"]))  # older JSON
        head = f"select {r['select_us']:.1f} us; generic select"
        if r.get("fused_select"):
            alone = "-" if r["fused_us"] is None else f"{r['fused_us']:.1f}"
            head = (f"fused select {r['select_us']:.1f} us (kernel call alone {alone} us; "
                    f"speed-up {r['select_speedup']:.1f}x over the generic select)")
        lines.append(
            f"{label(top)} B={r['batch']} {r['algorithm']}: {head} "
            f"{r['select_unfused_us']:.1f} us = score "
            f"{r['score_us']:.1f} us ({r['score_bw_tbs'] or 0:.2f} TB/s, "
            f"{r['score_bw_frac_copy'] or 0:.0%} of copy) + topk {r['topk_us']:.1f} us (unsorted "
            f"{r['topk_unsorted_us']:.1f}) + other ops {r['select_glue_us']:.1f} us; attend "
            f"{r['attend_us']:.1f} us; select = {r['select_share']:.0%} of select+attend; "
            f"select reads {r['select_over_attend_bytes']:.2f}x attend's bytes")
    dom = [r for r in at if r["select_share"] > 0.5]
    if dom:
        sugg.append(f"select dominates at {label(top)} for B in {sorted({r['batch'] for r in dom})}"
                    f"; by bytes alone select reads {dom[0]['select_over_attend_bytes']:.1f}x "
                    "attend (2 summary rows x every page vs K+V of the budget's pages)")
    generic = [r for r in at if not r.get("fused_select")]  # the fused kernel has no topk/glue
    tk = [r for r in generic if r["topk_us"] > 0.3 * r["select_us"]]
    if tk:
        worst = max(tk, key=lambda r: r["topk_us"] / r["select_us"])
        sugg.append(f"torch.topk is {worst['topk_us'] / worst['select_us']:.0%} of select at "
                    f"B={worst['batch']} ({worst['topk_us']:.1f} us for {worst['batch']}x"
                    f"{worst['pages_per_head']}-wide rows per KV head; sorted=False "
                    f"{worst['topk_unsorted_us']:.1f} us): fuse the top-k into the score kernel "
                    "(per (request, head) radix/threshold select) or at least use sorted=False")
    gl = [r for r in generic if r["select_glue_us"] > 0.3 * r["select_us"]]
    if gl:
        worst = max(gl, key=lambda r: r["select_glue_us"])
        sugg.append(f"the torch ops around score/topk in SparseAlgorithm.select cost "
                    f"{worst['select_glue_us']:.1f} us at B={worst['batch']}: fold the kept-page "
                    "(+inf) / last-page (-inf) masking into the score kernel and emit int32 page "
                    "ids from the top-k (drops ~10 elementwise kernels and 2 full-size temporaries)")
    slow = [r for r in generic if (r["score_bw_frac_copy"] or 0) < 0.6 and r["batch"] >= 16]
    if slow:
        sugg.append(f"the score kernel reaches {min(r['score_bw_frac_copy'] or 0 for r in slow):.0%}"
                    " of copy bandwidth at large batch: tune BLOCK_W / num_warps, or store kmin/kmax"
                    " interleaved per page ([S, 2, D]) so one gather reads both")
    fz = [r for r in at if r.get("fused_select") and (r["select_bw_frac_copy"] or 0) < 0.5]
    if fz:
        worst = min(fz, key=lambda r: r["select_bw_frac_copy"] or 0)
        sugg.append(f"the fused select (score + topk kernel) reaches "
                    f"{worst['select_bw_frac_copy'] or 0:.0%} of copy "
                    f"bandwidth at B={worst['batch']}: try num_splits / block_w / num_warps of "
                    "kernels.page_select.select_pages (SPARSESERVE_FUSED_SELECT=0: generic path)")
    return {"context": top, "lines": lines, "suggestions": sugg}


def targets(rows):
    sp = [r for r in rows if r["algorithm"] != "dense"]
    if not sp:
        return {"context": None, "rows": [], "all_met": None}
    top = max(r["context"] for r in sp)
    out = [{k: r[k] for k in ("batch", "algorithm", "ratio", "ratio_graph", "attend_bw_frac_copy",
                              "summary_frac", "meets")} for r in sp if r["context"] == top]
    return {"context": top, "is_128k": top == 131072, "thresholds": TARGETS, "rows": out,
            "all_met": all(all(r["meets"].values()) for r in out)}


def plot(rows, path, batches):
    """Top row: time per layer vs context (log). Bottom: select/attend stacked (linear), with
    dense / 10 (the 128k target) marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [b for b in batches if any(r["batch"] == b for r in rows)]
    algs = sorted({r["algorithm"] for r in rows} - {"dense"})
    nb = max(1, len(batches))
    fig, axes = plt.subplots(2, nb, figsize=(4.2 * nb, 7), squeeze=False)
    width = 0.8 / max(1, len(algs))
    for col, b in enumerate(batches):
        top, bot = axes[0][col], axes[1][col]
        get = {(r["context"], r["algorithm"]): r for r in rows if r["batch"] == b}
        ctxs = sorted({r["context"] for r in rows if r["batch"] == b})
        xs = range(len(ctxs))
        dense = [get[c, "dense"]["dense_us"] if (c, "dense") in get else None for c in ctxs]
        top.plot(xs, dense, "o-", color="0.4", label="dense")
        for j, a in enumerate(algs):
            rs = [get.get((c, a)) for c in ctxs]
            top.plot(xs, [r and r["select_plus_attend_us"] for r in rs], "s-", color=f"C{j}",
                     label=f"{a} select+attend")
            top.plot(xs, [r and r.get("graph_us") for r in rs], "^--", color=f"C{j}",
                     label=f"{a} CUDA graph")
            for i, r in enumerate(rs):
                if r is None:
                    continue
                x = i - 0.4 + (j + 0.5) * width
                bot.bar(x, r["select_us"], width * 0.9, color=f"C{j}", alpha=0.5,
                        label=f"{a} select" if i == 0 else None)
                bot.bar(x, r["attend_us"], width * 0.9, bottom=r["select_us"], color=f"C{j}",
                        label=f"{a} attend" if i == 0 else None)
        for i, d in enumerate(dense):
            if d is not None:
                bot.plot([i - 0.45, i + 0.45], [d / 10] * 2, "k--", lw=1,
                         label="dense / 10" if i == 0 else None)
        for ax in (top, bot):
            ax.set_xticks(list(xs), [label(c) for c in ctxs])
            ax.grid(axis="y", alpha=0.3, which="both")
        top.set_yscale("log")
        top.set_title(f"batch {b}")
        bot.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("time per layer (us, log)")
    axes[1][0].set_ylabel("sparse time per layer (us)")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle("sparse decode attention (select + attend) vs dense paged decode, per layer "
                 "(device time)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(C, rows, copy):
    dense = {(r["context"], r["batch"]): r for r in rows if r["algorithm"] == "dense"}
    pct = lambda x, dg=0: C.fmt(x * 100, dg) if x is not None else "-"  # noqa: E731
    out = [[label(r["context"]), r["batch"], r["algorithm"], C.fmt(r["dense_us"]),
            pct(dense.get((r["context"], r["batch"]), {}).get("bw_frac_copy")),
            C.fmt(r["select_us"]), C.fmt(r.get("select_unfused_us")), C.fmt(r["attend_us"]),
            C.fmt(r["select_plus_attend_us"]),
            C.fmt(r["graph_us"]), C.fmt(r["ratio"], 3), C.fmt(r["ratio_graph"], 3),
            pct(r["attend_bw_frac_copy"]), pct(r["select_bw_frac_copy"]), pct(r["summary_frac"], 2)]
           for r in rows if r["algorithm"] != "dense"]
    print(f"device copy: {C.fmt(copy.get('bw_tbs'), 2)} TB/s (read+write); us per layer, "
          "device time; %cp = achieved bandwidth / copy bandwidth")
    print(C.table(["ctx", "B", "alg", "dense", "dense%cp", "select", "generic", "attend",
                   "sel+att", "graph",
                   "sparse/dense", "graph/dense", "att%cp", "sel%cp", "summ%KV"], out))


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    import common as C

    s = dict(SMOKE if args.smoke else FULL)
    s.update(smoke=args.smoke, algorithms=[a for a in args.algorithms.split(",") if a],
             max_kv_gb=args.max_kv_gb, max_kv_scope=args.max_kv_scope, budget_s=args.budget_s, graphs=not args.no_graph)
    if args.contexts:
        s["contexts"] = args.contexts
    if args.batches:
        s["batches"] = args.batches
    device = torch.device(s["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --smoke for the CPU path", file=sys.stderr)
        return 2
    backend = "triton"  # the Triton kernels also on the CPU (interpreter) in --smoke
    dtype = getattr(torch, s["dtype"])
    es = torch.empty((), dtype=dtype).element_size()
    deadline = C.Deadline(s["budget_s"])
    torch.manual_seed(0)
    result = {**C.meta(argv if argv is None else [sys.argv[0], *argv]),
              "benchmark": "sparse_decode", "settings": s, "targets_spec": TARGETS,
              "copy": None, "rows": [], "skipped": [], "errors": [], "complete": False}
    json_path = os.path.join(args.out, "sparse_decode.json") if args.out else None

    def save():
        result["elapsed_s"] = deadline.elapsed()
        if json_path:
            C.write_json(json_path, result)

    def fail(exc, **where):
        result["errors"].append({**where, **C.error_record(exc)})
        print(f"ERROR {where}: {type(exc).__name__}: {exc}"[:400], file=sys.stderr, flush=True)

    bench = Bench(torch, C, s, device)
    try:
        result["copy"] = measure_copy(torch, bench, s, device)
    except Exception as exc:  # noqa: BLE001
        fail(exc, stage="copy")
        result["copy"] = {"bw_tbs": None}
    copy_bw = result["copy"]["bw_tbs"]
    tidy = lambda: _quiet(C.free_device_memory)  # noqa: E731 - survives a dead CUDA context
    tidy()  # return the copy buffers before sizing the KV pools
    save()
    for ctx in s["contexts"]:
        n = -(-ctx // s["page_size"])
        free = _quiet(lambda: torch.cuda.mem_get_info()[0]) if bench.cuda else None
        per_req = kv_bytes(s, n * s["page_size"], 1, es) * (1 + 2.5 / s["page_size"])  # + summaries
        fits = []
        for b in s["batches"]:
            why = None
            kv = kv_bytes(s, ctx, b, es) * (s["num_layers"] if s["max_kv_scope"] == "model" else 1)
            if kv > s["max_kv_gb"] * 1e9:
                why = f"{s['max_kv_scope']} K+V {kv / 1e9:.1f} GB > --max-kv-gb {s['max_kv_gb']}"
            elif free is not None and b * per_req + (2 << 30) > 0.9 * free:
                why = f"needs ~{b * per_req / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
            if why:
                result["skipped"].append({"context": ctx, "batch": b, "reason": why})
            else:
                fits.append(b)
        if not fits:
            continue
        pool = None
        try:
            pool = build_pool(torch, s, device, dtype, ctx, max(fits), s["algorithms"])
        except Exception as exc:  # noqa: BLE001
            fail(exc, context=ctx, stage="build_pool")
        for b in fits if pool is not None else []:
            if deadline.expired(reserve_s=15):
                result["skipped"].append({"context": ctx, "batch": b, "reason": "time budget"})
                continue
            try:
                rows = measure_combo(torch, bench, s, pool, ctx, b, copy_bw, backend, s["graphs"])
                result["rows"] += rows
                r = rows[-1]
                print(f"{label(ctx)} B={b}: dense {rows[0]['dense_us']:.1f} us, {r['algorithm']} "
                      f"select {r['select_us']:.1f} + attend {r['attend_us']:.1f} us "
                      f"(graph {C.fmt(r['graph_us'])}) [{deadline.elapsed():.0f} s]", flush=True)
            except Exception as exc:  # noqa: BLE001
                fail(exc, context=ctx, batch=b, stage="measure")
            save()
        pool = None
        gc.collect()
        tidy()
    try:
        result["select_analysis"] = analyse(result["rows"])
        result["targets"] = targets(result["rows"])
        if args.out and result["rows"]:
            result["plot"] = plot(result["rows"], os.path.join(args.out, "sparse_decode.png"),
                                  s["batches"])
    except Exception as exc:  # noqa: BLE001
        fail(exc, stage="analysis/plot")
    result["complete"] = not result["errors"] and not result["skipped"]
    save()
    an, t = result.get("select_analysis") or {}, result.get("targets") or {}
    print("\nselect analysis:")
    for line in an.get("lines", []) + an.get("suggestions", []):
        print("  " + line)
    print(f"targets at {label(t['context']) if t.get('context') else '-'}: all met = "
          f"{t.get('all_met')}; errors {len(result['errors'])}, skipped {len(result['skipped'])}, "
          f"{deadline.elapsed():.0f} s{'; JSON ' + json_path if json_path else ''}\n")
    if result["rows"]:
        print_table(C, result["rows"], result["copy"])
    return 1 if result["errors"] else 0


def _quiet(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
