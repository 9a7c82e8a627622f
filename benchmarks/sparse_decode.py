"""Sparse decode attention per layer vs dense paged decode (DESIGN.md §4, issue 3 "Benchmark").

Llama-3-8B layer shapes (32 query / 8 KV heads, head_dim 128), bf16, page 32, contexts 8k /
32k / 128k, batch 1 / 4 / 16 / 64, token budget 2048 (64 pages; sink 1, local 2 pages). One
layer's K/V pool holds every request's pages in a random physical order (fragmentation). Per
(context, batch), CUDA events, median over reps after warm-up, L2 flushed before every rep:

* dense:  ``paged_decode_attention`` over all pages;
* select: the algorithm's ``select`` (for arkvale and quest the fused Triton kernel
  ``kernels.select_pages``: per-head bounds, mass scores, kept pages and top-k in one kernel,
  or two launches in split mode; for keycode2 the same kernel decoding key codes; for the
  key-code shortlist ``keycode2-sl`` / ``keycode2-sl2`` ``kernels.select_pages_shortlist``:
  the box select at budget S = 4 / 2 x budget, the code select over those S pages, a gather;
  for ``keycode2-sparq`` the channel choice ``kernels.sparq_channels`` then ``select_pages``
  with ``sparq_chan=``; the width-sum cache is warm after the first call, as in decode steps
  where no page fills: ``SPARSESERVE_SPARQ_WIDTH_CACHE=0`` times the recompute every call);
  attend:
  ``paged_decode_attention`` over the selection; their sum; and select + attend captured together
  in one CUDA graph;
* fused: the algorithm's kernel path (``kernels.select_pages``, with ``codes=`` for key codes;
  ``kernels.select_pages_shortlist`` for the shortlist) called directly with the run's kernel
  backend (so ``--smoke`` runs the Triton kernels in the interpreter; on the GPU it is
  ``select`` minus the wrapper);
* select_unfused: the generic ``SparseAlgorithm.select`` (per-head score kernel + torch mass
  normalisation + ~25 torch ops + topk), the path the fused kernel replaces, and its breakdown:
  the score (``alg.score``: kernel + mass) alone,
  ``torch.topk`` alone (sorted / unsorted), the rest (``select_glue_us``);
* bytes each reads (dense: all K/V; attend: the selected pages' K/V; select: every summary
  row of every page + page table — for the shortlist: every page's box, box and codes of the S
  shortlisted pages only; for keycode2-sparq the int8 mean and the R chosen channels' box and
  codes of every page, and ``select_sector_bytes``: the 32-byte sectors those lie in;
  ``checks.spec_set_mismatch_frac``: its selection of request 0 vs ``ref.select_pages_shortlist``) -> TB/s and its fraction of a device-to-device copy measured in the same run
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
    python benchmarks/sparse_decode.py --out DIR --contexts 131072 --batches 16 \
        --algorithms arkvale,keycode2,keycode2-sl,keycode2-sl2 --budget-s 120  # the shortlist
    python benchmarks/sparse_decode.py --out DIR --contexts 131072 --batches 16 \
        --algorithms keycode2-sparq,keycode2-c4,keycode2 --budget-s 200  # runtime channels
    python benchmarks/sparse_decode.py --out DIR --contexts 131072 --batches 16 --no-graph \
        --algorithms keycode2-sparq,keycode2-sparq@decode_asm=0,keycode2-sparq@score_kernel=1

``--algorithms`` takes variants ``name@attr=value+attr=value`` (class attributes of the
algorithm overridden; variants of one algorithm share its summaries unless their layouts
differ): above, keycode2-sparq's score phase ``kernels/sparq_tiles.py`` with and without its
bf16x2 decode, and its first version ``sparq_codes.sparq_page_x``; ``keycode2-sparq@records=0``
its first summary layout (box and codes in separate rows) against the per-channel records.
    python benchmarks/sparse_decode.py --smoke --out DIR  # CPU, Triton interpreter

Writes DIR/sparse_decode.json (rows, command, GPU, versions, date) and DIR/sparse_decode.png;
prints the select analysis, then a table last. Exit status 1 if any measurement failed.

This file holds the settings, the arguments and the loop over (context, batch); the rest
lives beside it: sparse_decode_timing.py, sparse_decode_measure.py, sparse_decode_report.py.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

# nothing below imports torch or triton when loaded: --smoke sets TRITON_INTERPRET first
from sparse_decode_measure import TARGETS, build_pool, kv_bytes, measure_combo  # noqa: E402
from sparse_decode_report import analyse, label, plot, print_table, targets  # noqa: E402
from sparse_decode_timing import Bench, measure_copy  # noqa: E402

FULL = dict(device="cuda", dtype="bfloat16", num_q_heads=32, num_kv_heads=8, head_dim=128,
            page_size=32, num_layers=32, contexts=[8192, 32768, 131072], batches=[1, 4, 16, 64],
            token_budget=2048, sink_pages=1, local_pages=2, warmup=3, min_reps=10, max_reps=50,
            target_s=0.2, copy_mib=2048, flush_mib=256, spin_cycles=2_000_000)
# fp32 in --smoke: Triton 3.6's interpreter computes tl.dot on bf16 operands wrongly (~1e10)
SMOKE = dict(FULL, device="cpu", dtype="float32", num_q_heads=4, num_kv_heads=2, head_dim=16,
             contexts=[256, 512], batches=[1, 2], token_budget=128, warmup=1, min_reps=2,
             max_reps=2, target_s=0.0, copy_mib=16, flush_mib=0, spin_cycles=0)


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
    p.add_argument("--page-chunk", type=int, default=1,
                   help="pages come in aligned chunks of this many per (request, KV head), in "
                        "random chunk order (16: the two-tier cache's host pages; summaries "
                        "may then interleave them); 1: every page in random order")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    import common as C

    s = dict(SMOKE if args.smoke else FULL)
    s.update(smoke=args.smoke, algorithms=[a for a in args.algorithms.split(",") if a],
             max_kv_gb=args.max_kv_gb, max_kv_scope=args.max_kv_scope, budget_s=args.budget_s, graphs=not args.no_graph,
             page_chunk=args.page_chunk)
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
