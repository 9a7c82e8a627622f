"""HBM bytes of the two-tier cache's metadata per request: two-level page table vs a flat
per-page table (issue 4). Pure arithmetic (no GPU) with the engine's chunk size
(HOST_CHUNK_PAGES) and residency-table sizing (kernels/residency_hash.table_size), for the
layouts of PageDirectory, TwoTierCache's per-slot arrays and SparseRuntime's summaries; a test
checks those tensors on real engines.

    python benchmarks/metadata_bytes.py --out docs/results/data

Flat design (what the engine had before): a per-page device page table (int32 per block and
KV head) and a residency map with one int64 slot entry per host page and layer — both grow
with the context (the address space). Two-level: a chunk directory (int32 per chunk of
HOST_CHUNK_PAGES pages and KV head) and a residency hash table sized by the device slots —
it grows with the working set the request keeps in HBM, whatever its context.
Both designs also keep per-slot arrays (page_of, last_access, owner: 3 x int64 per slot and
layer) and the page summaries (the sparse algorithm's, 2 vectors per page, KV head and
layer), listed separately.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sparseserve.config import HOST_CHUNK_PAGES  # noqa: E402
from sparseserve.kernels.residency_hash import table_size  # noqa: E402

MiB = 1 << 20
SHAPES = {  # layers, KV heads, head dim, bytes per element (bf16)
    "llama-3-8b": (32, 8, 128, 2),
}


def per_request(ctx: int, shape, page_size: int, budget: int, buffer_factor: float,
                batch: int) -> dict:
    L, hkv, d, esz = shape
    blocks = -(-ctx // page_size)
    chunks = -(-blocks // HOST_CHUNK_PAGES)
    # the request's device working set: its selection (mandatory) plus buffering slots
    quota = int(hkv * (budget // page_size) * buffer_factor)  # slots per layer
    slots = batch * quota  # the pool the batch shares
    index = L * table_size(slots + 1) * 4 / batch
    flat = {"page_table": hkv * blocks * 4, "residency_map": L * hkv * blocks * 8}
    two = {"directory": hkv * chunks * 4, "residency_index": index}
    per_slot = L * quota * 3 * 8
    summaries = L * hkv * blocks * 2 * d * esz
    return {
        "context": ctx, "blocks_per_head": blocks, "slots_per_layer": quota,
        "flat": flat, "two_level": two, "flat_total": sum(flat.values()),
        "two_level_total": sum(two.values()), "per_slot_arrays": per_slot,
        "summaries": summaries, "kv_bytes": L * hkv * blocks * page_size * d * esz * 2,
    }


def table(rows: list[dict]) -> str:
    out = ["| context | flat: page table + residency map | two-level: directory + residency "
           "index | two-level / flat | per-slot arrays (both) | summaries (both) |",
           "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['context'] // 1024}k | {r['flat_total'] / MiB:.3f} MiB | "
                   f"{r['two_level_total'] / MiB:.3f} MiB | "
                   f"{r['two_level_total'] / r['flat_total']:.3f} | "
                   f"{r['per_slot_arrays'] / MiB:.2f} MiB | {r['summaries'] / MiB:.0f} MiB |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--buffer-factor", type=float, default=2.0,
                   help="device slots per request = factor x its selection (elastic buffer)")
    p.add_argument("--batch", type=int, default=32)
    a = p.parse_args(argv)
    rows = [per_request(c, SHAPES[a.model], a.page_size, a.token_budget, a.buffer_factor,
                        a.batch) for c in (8192, 32768, 131072)]
    result = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
              "model": a.model, "page_size": a.page_size, "chunk_pages": HOST_CHUNK_PAGES,
              "token_budget": a.token_budget, "buffer_factor": a.buffer_factor,
              "batch": a.batch, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "metadata_bytes.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
