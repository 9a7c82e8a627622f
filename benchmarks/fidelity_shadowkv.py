"""`sparseserve eval fidelity` with shadowkv registered (and two of its scoring variants).

The fidelity harness in-process with shadowkv's evaluation-only variants registered (the CLI
knows only the engine's algorithms). Added here,
evaluation only (not engine code), over shadowkv's own summaries:

* ``shadowkv-sum``   — per page the *sum* of its chunks' softmax scores (the page's estimated
  mass) instead of the max;
* ``shadowkv-noout`` — landmark scores only (no outlier pages).

Fast mode: shadowkv's chunk logits from one read of the text's landmarks for all rows (like
``fidelity_shared.shared_codes_class``), checked equal to the generic score on the first call
of each run.

    nice -n 10 python benchmarks/fidelity_shadowkv.py --lengths 8192 --budgets 512 2048 \
        --algorithms shadowkv shadowkv-sum shadowkv-noout arkvale keycode2 oracle \
        --num-texts 2 --tail 256 --sweep-algorithms keycode2 --sweep-settings s1l2d0 \
        --no-needle --no-plot --out OUT
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch

import sparseserve.sparse.shadowkv  # noqa: F401  (registers "shadowkv")
from sparseserve.bench import fidelity_tail, fidelity_variants
from sparseserve.sparse.shadowkv import ShadowKV


class ShadowKVSum(ShadowKV):
    page_reduce = "sum"


class ShadowKVNoOutliers(ShadowKV):
    outlier_fraction = 0.0


for _name, _cls in (("shadowkv-sum", ShadowKVSum), ("shadowkv-noout", ShadowKVNoOutliers)):
    fidelity_variants.VARIANTS[_name] = "shadowkv"
    fidelity_variants.CLASSES[_name] = _cls


def shared_shadowkv_class(cls):
    class SharedShadowKV(cls):
        shared = None
        checked = False

        def chunk_logits(self, q, page_table, num_pages, summaries):
            sh = self.shared
            if sh is None or not sh.covers(page_table, num_pages):
                return super().chunk_logits(q, page_table, num_pages, summaries)
            b, hq, d = q.shape
            w, c = page_table.shape[2], self.n_chunks
            rows = sh.page_rows(w)
            lm = summaries["landmarks"].view(-1, c, d)[rows].float()        # [Hkv, w, C, D]
            gap = summaries["cosgap"].view(-1, c)[rows].float().unsqueeze(0)  # [1, Hkv, w, C]
            x = torch.einsum("bhgd,hwcd->bhgwc", q.float().view(b, sh.hkv, hq // sh.hkv, d), lm)
            return x, gap

        def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
            s = super().score(q, page_table, num_pages, last_page_len, summaries, k_cache)
            if not type(self).checked:  # the fast path is the generic one
                x, gap = cls.chunk_logits(self, q, page_table, num_pages, summaries)
                ref = self.from_chunk_logits(x, gap, num_pages, q.shape[-1] ** -0.5)
                torch.testing.assert_close(s, ref, atol=1e-5, rtol=1e-4)
                type(self).checked = True
            return s

    SharedShadowKV.__name__ = f"Shared{cls.__name__}"
    return SharedShadowKV


fidelity_tail.register_fast(ShadowKV, shared_shadowkv_class)


def main(argv=None) -> int:
    from sparseserve.bench.fidelity import run_fidelity, write_results
    from sparseserve.bench.fidelity_cli import add_eval_args

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fidelity_shadowkv")
    add_eval_args(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", "fidelity"] + argv)
    args.command_line = "python benchmarks/fidelity_shadowkv.py " + " ".join(
        shlex.quote(a) for a in argv)
    out = run_fidelity(args, lambda m: print(m, flush=True),
                       save=lambda o: write_results(o, args.out))
    jpath, mpath = write_results(out, args.out)
    print(f"wrote {jpath} and {mpath}")
    with open(mpath) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
