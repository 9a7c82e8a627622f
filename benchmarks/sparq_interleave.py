"""keycode2-sparq's fused select with its records interleaved in chunks of pages vs in their
pages' rows (``kernels/sparq_records.interleave``; issue 11's cost target).

Why: Nsight Compute on the H100 (twenty-sixth session) put the score phase at 58 % of DRAM
bandwidth moving ~1 KB per page of a row — the 16 chosen channels' 16-byte records each pull a
64-byte DRAM burst out of the page's 2 KB row — against ~390 B the select uses. With the
records of one channel of a chunk's 16 pages contiguous, a sub-tile (16 consecutive entries of
a row = one allocation chunk) reads whole bursts.

Pool: Llama-3-8B layer shapes (8 KV heads of 4 query heads, head_dim 128), bf16, page 32,
contexts in pages of aligned 16-page chunks of one (request, KV head), chunks in random
physical order (the engine's host-page allocation); also the fully random page order of
sparse_decode.py for the un-interleaved records. Per layout: the channel choice then
``select_pages`` (device time: CUDA events, median of `--reps`, L2 flushed before each);
the selected pages must equal the un-interleaved select's.

    python benchmarks/sparq_interleave.py --out $OUT/interleave.json   # GPU, ~1 minute
    python benchmarks/sparq_interleave.py --smoke --out /tmp/i.json      # CPU interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402


def build(torch, ctx, batch, hkv, d, ps, chunk, dtype, device, seed=0):
    """K pages of `batch` requests, a chunked page table and one in random page order."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = -(-ctx // ps)
    nch = -(-n // chunk)
    P = batch * hkv * nch * chunk
    k = torch.randn(P, ps, d, generator=g).to(dtype).to(device)
    chunks = torch.randperm(P // chunk, generator=g).view(batch, hkv, nch)
    table = (chunks[..., None] * chunk + torch.arange(chunk)).view(batch, hkv, -1)[..., :n]
    rand = torch.randperm(P, generator=g)[:batch * hkv * n].view(batch, hkv, n)
    return k, table.to(torch.int32).to(device), rand.to(torch.int32).to(device), n, P


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, Triton interpreter")
    a = p.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from sparseserve.kernels.page_select import select_pages
    from sparseserve.kernels.sparq_codes import sparq_channels
    from sparseserve.kernels.sparq_records import interleave, record_words
    from sparseserve.sparse.base import LayerSummaries
    from sparseserve.sparse.keycode_sparq import KeyCodeSparQ

    device = "cpu" if a.smoke else "cuda"
    ctx, batch = (4097, 2) if a.smoke else (a.context, a.batch)
    hkv, G, d, ps, chunk = 8, 4, 128, 32, 16
    dtype = torch.bfloat16
    k, table, rand, n, P = build(torch, ctx, batch, hkv, d, ps, chunk, dtype, device)
    alg = KeyCodeSparQ(ps, 2048 // ps, 1, 2)
    alg.interleave = 1  # the rows layout; the interleaved copy is made below
    summ = alg.make_summaries(P + chunk, d, dtype, device)  # + a chunk: the scratch row's
    ids = torch.arange(P, dtype=torch.int32, device=device)
    ntok = torch.full((P,), ps, dtype=torch.int32, device=device)
    for i in range(0, P, 1 << 16):
        alg.index(k, ids[i:i + (1 << 16)], ntok[i:i + (1 << 16)], summ, None)
    del k
    v = alg.views(summ)
    nr = record_words(dtype.itemsize, ps)
    rec_i = interleave(v["rec"], nr, chunk)
    # the random table's own copy: the channel choice caches width sums per page, and those
    # depend on the row's page order
    v_rand = alg.views(LayerSummaries({n: t.clone() for n, t in summ.tensors.items()},
                                      summ.shapes))
    q = torch.randn(batch, hkv * G, d, dtype=dtype, device=device)
    num = torch.full((batch, hkv), n, dtype=torch.int32, device=device)
    last = torch.full((batch,), ps, dtype=torch.int32, device=device)

    def select(tab, rec, ri, vs=v):
        # the channel choice reads the rows layout in every case (the same few µs): the
        # engine's interleaved channel choice is timed by sparse_decode.py --page-chunk 16
        ch = sparq_channels(q, vs["kmin"], vs["kmax"], vs["wsum"], tab, num, alg.channels)
        return select_pages(q, vs["kmin"], vs["kmax"], tab, num, last, alg.budget_pages,
                            alg.sink_pages, alg.local_pages, codes=vs["codes"], bits=2,
                            kmean=vs["kmean"], kscale=vs["kscale"], sparq_chan=ch,
                            sparq_rec=rec, rec_interleave=ri)

    if a.smoke:  # the interleaved records read as rows must select other pages (a live check)
        bad = select(table, rec_i, 1)
        assert not torch.equal(bad[0], select(table, v["rec"], 1)[0])
    cases = {"random pages, rows": (rand, v_rand["rec"], 1, v_rand),
             "chunked pages, rows": (table, v["rec"], 1),
             f"chunked pages, interleaved x{chunk}": (table, rec_i, chunk)}
    ref = {name: select(*c) for name, c in cases.items()}
    same = bool(torch.equal(ref["chunked pages, rows"][0], ref[f"chunked pages, interleaved x{chunk}"][0])
                and torch.equal(ref["chunked pages, rows"][1], ref[f"chunked pages, interleaved x{chunk}"][1]))
    res = {"context": ctx, "batch": batch, "pages": n, "interleave": chunk,
           "selection_equal": same, "us": {}}
    if device == "cuda":
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        for name, c in cases.items():
            times = []
            for _ in range(a.reps + 3):
                flush.zero_()
                # device time: the GPU sleeps while the host queues the launches, so the
                # events time the kernels, not the Python that launches them
                torch.cuda._sleep(2_000_000)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                select(*c)
                e.record()
                torch.cuda.synchronize()
                times.append(1e3 * s.elapsed_time(e))
            res["us"][name] = sorted(times[3:])[len(times[3:]) // 2]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(C.table(["layout", "select us (channel choice + select_pages)"],
                  [[k2, C.fmt(v2)] for k2, v2 in res["us"].items()]))
    print(f"selection equal (chunked rows vs interleaved): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
