"""Host time of an eager layer-segment step's O(prompt) plan work, with and without the
per-request plans that a prompt's segment steps share (worker/segment_plans.py), on the CPU.

Llama-3-8B shapes (Hkv 8, page 32, chunk_pages 16), 8 decode rows + one slot-free prompt of T
tokens running layers [l, l + 2) (a later segment step: the entry made by the previous one).
Each step drives the runner's real pieces: SegmentPlans.for_step, step_token_arrays, the three
token arrays' to_device, and OffloadForwardContext's _prefill_plan and _step_save_plan (its
save destinations via SegmentPlans.save_dest -> PageDirectory.step_host_pages, the SavePlan,
its device ids) on a context holding just what those read. "off": for_step gives no entry
(every step builds its own plans: the code before); "on": the entry of the previous segment.
On CPU tensors the device copies are views (no pinned copy): the CUDA H2D staging of the
plan's ids is not in these numbers. Min over repeats, off / on interleaved.

    .venv/bin/python benchmarks/segment_plan_host.py [--tokens 2048,8192,32768] [--repeats 15]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparseserve.engine.sched_output import ScheduledChunk  # noqa: E402
from sparseserve.worker.forward_context import PrefillSeq  # noqa: E402
from sparseserve.worker.host_copy import to_device  # noqa: E402
from sparseserve.worker.offload_cache import TwoTierCache  # noqa: E402
from sparseserve.worker.offload_context import OffloadForwardContext  # noqa: E402
from sparseserve.worker.page_directory import PageDirectory  # noqa: E402
from sparseserve.worker.segment_plans import SegmentPlans  # noqa: E402
from sparseserve.worker.step_arrays import step_token_arrays  # noqa: E402

HKV, PS, CHUNK_PAGES, DECODE_ROWS, HOST_PAGES = 8, 32, 16, 8, 400_000
CPU = torch.device("cpu")


class _Cache(SimpleNamespace):
    save_plan = TwoTierCache.save_plan  # the real one (make_save_plan, not validated)


def _setup(tokens: int):
    rows = DECODE_ROWS + 2
    max_blocks = -(-(tokens + 64) // PS)
    pages = PageDirectory(rows, HKV, max_blocks, CHUNK_PAGES, HOST_PAGES, CPU)
    rng = np.random.default_rng(0)
    pages.chunks_np[:rows] = rng.integers(0, HOST_PAGES // CHUNK_PAGES - 1,
                                          pages.chunks_np[:rows].shape)
    prompt = rng.integers(10, 100_000, tokens).tolist()
    cache = _Cache(num_host_pages=HOST_PAGES, page_size=PS,
                   page_of=torch.zeros(1, dtype=torch.long))
    return pages, prompt, cache


def _step(pages, plans, cache, prompt, layer: int, shared: bool) -> None:
    """One segment step's plan work (layers [layer, layer + 2) of the prompt)."""
    chunks = [ScheduledChunk(f"d{i}", i, [5], 600, 0, 32, True, 3) for i in range(DECODE_ROWS)]
    chunks.append(ScheduledChunk("p", DECODE_ROWS, prompt, 0, layer, layer + 2, False, 0,
                                 slot_free=True, resident_pages=0))
    step = plans.for_step(chunks) if shared else {}
    ids, pos, rws, offsets = step_token_arrays(chunks)
    for a in (ids, pos, rws):
        to_device(a, torch.long, CPU)
    c = chunks[-1]
    ctx = object.__new__(OffloadForwardContext)
    ctx.kv, ctx.pages, ctx.cache, ctx.num_decode = SimpleNamespace(page_size=PS), pages, cache, \
        DECODE_ROWS
    ctx.prefills = [PrefillSeq(offsets[-1], offsets[-1] + c.num_tokens, c.start, c.row, True, 0,
                               step.get(c.request_id))]
    ctx._prefill_plans = {}
    ctx.save_dest = lambda: plans.save_dest(chunks, pos, rws, step)
    ctx._prefill_plan(ctx.prefills[0])
    ctx._step_save_plan(DECODE_ROWS).device_ids(CPU)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'tokens':>7} {'off ms':>8} {'on ms':>8} {'saved':>8}   (min of {args.repeats} x "
          f"{args.rounds} rounds, interleaved)")
    for tokens in (int(t) for t in args.tokens.split(",")):
        pages, prompt, cache = _setup(tokens)
        plans = SegmentPlans(pages, PS, num_layers=1 << 30)  # the entry never ends
        layer = [0]

        def run(shared: bool) -> float:
            best = 1e9
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                _step(pages, plans, cache, prompt, layer[0], shared)
                best = min(best, time.perf_counter() - t0)
                layer[0] += 2 if shared else 0  # the next segment of the entry's chunk
            return best * 1e3
        _step(pages, plans, cache, prompt, 0, True)  # the first segment: builds the entry
        layer[0] = 2
        off, on = [], []
        for _ in range(args.rounds):
            off.append(run(False))
            on.append(run(True))
        assert plans.builds == 1, "a later segment step rebuilt its plans"
        print(f"{tokens:7d} {min(off):8.3f} {min(on):8.3f} {min(off) - min(on):8.3f}")


if __name__ == "__main__":
    main()
