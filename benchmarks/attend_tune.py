"""Launch sweep of sparse decode's attend: ``paged_decode_attention`` over a selection-shaped
page table (every (request, KV head) its own ``--pages`` random physical pages of a pool, as
the select returns them), Llama-3-8B layer shapes (32 query / 8 KV heads, head_dim 128), bf16,
page 32. For each batch: the default launch (``_launch_config`` + ``default_num_splits``) and
every (block_n, num_warps, num_stages) x num_splits of the grid, device time as
``sparse_decode.py`` takes it (``sparse_decode_timing.Bench``: a spin kernel holds the GPU
while the launches queue, so a small launch is not timed by its host overhead; L2 flushed
before each rep; median; main kernel + split merge), and each one's output checked against
the default's. (The first version timed with ``triton.testing.do_bench``, whose events also
caught the launcher's host time: at batch 1 and 4 its numbers were launch-bound noise.) Writes JSON; prints the best launches per batch
and their speedup over the default, measured in the same run.

    python benchmarks/attend_tune.py --out $OUT/attend_tune.json --batches 1,4,16,64
    python benchmarks/attend_tune.py --out /tmp/a.json --smoke    # CPU, the interpreter
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=_ints, default=[1, 4, 16, 64])
    p.add_argument("--pages", type=int, default=64, help="selected pages per (request, KV head)")
    p.add_argument("--pool-pages", type=int, default=1 << 16, help="physical pages of the pool")
    p.add_argument("--block-n", type=_ints, default=[32, 64, 128])
    p.add_argument("--warps", type=_ints, default=[2, 4, 8])
    p.add_argument("--stages", type=_ints, default=[1, 2, 3, 4])
    p.add_argument("--splits", type=_ints, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--smoke", action="store_true", help="tiny shapes in Triton's interpreter")
    a = p.parse_args()
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from sparse_decode_timing import Bench

    from sparseserve.kernels import paged_decode as PD

    dev = "cpu" if a.smoke else "cuda"
    hq, hkv, d, ps = 32, 8, 128, 32
    if a.smoke:
        hq, hkv, a.pool_pages, a.pages = 8, 2, 64, 5
        a.batches, a.block_n, a.warps, a.stages, a.splits = [1, 3], [32, 64], [4], [2], [1, 2]
    dtype = torch.float32 if a.smoke else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(a.pool_pages, ps, d, generator=gen).to(dev, dtype)
    v = torch.randn(a.pool_pages, ps, d, generator=gen).to(dev, dtype)
    bench = Bench(torch, C, dict(flush_mib=256, warmup=3, min_reps=10, max_reps=100,
                                 target_s=0.05, spin_cycles=2_000_000), torch.device(dev))
    rows, best = [], []
    for b in a.batches:
        q = torch.randn(b, hq, d, generator=gen).to(dev, dtype)
        table = torch.randint(0, a.pool_pages, (b, hkv, a.pages), generator=gen,
                              dtype=torch.int32).to(dev)
        npg = torch.full((b, hkv), a.pages, dtype=torch.int32, device=dev)
        last = torch.full((b,), ps, dtype=torch.int32, device=dev)

        def call(**kw):
            return PD.paged_decode_attention(q, k, v, table, npg, last, d ** -0.5, **kw)

        want = call()
        sms = PD._num_sms(q.device)
        default = dict(config=PD._launch_config(ps, d), num_splits=PD.default_num_splits(
            b, hkv, a.pages, PD._launch_config(ps, d)[0] // ps, sms))

        def time_us(fn):
            if a.smoke:
                fn()
                return None
            return bench.time(fn, latency=False)["gpu"]["median"]

        base_us = time_us(call)
        kv_bytes = 2 * b * hkv * a.pages * ps * d * k.element_size()
        rows.append(dict(batch=b, default=True, us=base_us, **default))
        for bn, w, st, ns in itertools.product(a.block_n, a.warps, a.stages, a.splits):
            cfg = (bn, w, st)
            try:
                out = call(config=cfg, num_splits=ns)
                err = (out.float() - want.float()).abs().max().item()
                us = time_us(lambda: call(config=cfg, num_splits=ns))
            except Exception as exc:  # noqa: BLE001 - an out-of-resources launch is a result
                rows.append(dict(batch=b, config=cfg, num_splits=ns, error=C.error_record(exc)))
                continue
            rows.append(dict(batch=b, config=cfg, num_splits=ns, us=us, max_abs_err=err,
                             ok=err < (1e-3 if a.smoke else 2e-2),
                             tbs=kv_bytes / (us * 1e-6) / 1e12 if us else None,
                             speedup=base_us / us if us and base_us else None))
        ok = [r for r in rows if r["batch"] == b and r.get("ok")]
        if ok and not a.smoke:
            r = min(ok, key=lambda r: r["us"])
            best.append([b, C.fmt(base_us), str(default["config"]), default["num_splits"],
                         C.fmt(r["us"]), str(r["config"]), r["num_splits"], f"{r['speedup']:.2f}",
                         f"{r['tbs']:.2f}"])
    C.write_json(a.out, {"meta": C.meta(), "pages": a.pages, "pool_pages": a.pool_pages,
                         "shape": dict(hq=hq, hkv=hkv, head_dim=d, page_size=ps), "rows": rows})
    print(C.table(["batch", "default us", "config", "splits", "best us", "config", "splits",
                   "x", "TB/s"], best))
    bad = [r for r in rows if r.get("ok") is False]
    print(f"{len(rows)} launches, {len(bad)} with outputs off the default's")


if __name__ == "__main__":
    main()
