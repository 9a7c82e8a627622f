"""`sparseserve eval fidelity` with evaluation variants of the key-code shortlist
(``sparse/keycode_shortlist.py``) registered — diagnostics of where the shortlist loses
answers, not engine code:

* ``keycode2-sl-allnorm`` / ``keycode2-sl2-allnorm`` — the shortlist's pages (the box top-S,
  S = 4 / 2 x budget), but each head's code-mass softmax over *every* full page, as keycode2
  normalises (so it reads every page's codes: no saving). Equal to keycode2 where the
  shortlist holds keycode2's choice; the gap to the shortlist algorithm is what normalising
  over the shortlist costs, the gap to keycode2 what the box shortlist misses.

Fast mode: the shortlist algorithms' shared-text twin (``fidelity_shared``), which calls the
variant's ``from_code_bounds`` with the code bounds of every page.

    nice -n 10 python benchmarks/fidelity_shortlist.py --lengths 8192 --budgets 512 2048 \\
        --algorithms keycode2-sl keycode2-sl-allnorm keycode2-sl2-allnorm --num-texts 2 \\
        --tail 256 --sweep-algorithms keycode2-sl --sweep-settings s1l2d0 --no-needle \\
        --no-plot --out OUT
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch

from sparseserve.bench import fidelity_variants
from sparseserve.kernels import code_page_bounds, head_bounds
from sparseserve.kernels.ref import mass_from_bounds
from sparseserve.sparse.keycode_shortlist import KeyCode2Shortlist, KeyCode2Shortlist2


class AllNorm:
    """Shortlist membership, keycode2's normalisation (every full page's codes)."""

    def from_code_bounds(self, code_bounds, in_short, num_pages, scale):
        mass = mass_from_bounds(code_bounds, num_pages, self.sink_pages, self.local_pages,
                                scale)
        return mass.masked_fill(~in_short, float("-inf"))

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        kmin, kmax = summaries["kmin"], summaries["kmax"]
        scale = q.shape[-1] ** -0.5
        in_short = self.shortlist(head_bounds(q, kmin, kmax, page_table, num_pages),
                                  num_pages, scale)
        code = code_page_bounds(q, kmin, kmax, summaries["codes"], page_table, num_pages,
                                self.bits)
        return self.from_code_bounds(code, in_short, num_pages, scale)


class KeyCode2ShortlistAllNorm(AllNorm, KeyCode2Shortlist):
    pass


class KeyCode2Shortlist2AllNorm(AllNorm, KeyCode2Shortlist2):
    pass


for _name, _base, _cls in (("keycode2-sl-allnorm", "keycode2-sl", KeyCode2ShortlistAllNorm),
                           ("keycode2-sl2-allnorm", "keycode2-sl2", KeyCode2Shortlist2AllNorm)):
    fidelity_variants.VARIANTS[_name] = _base
    fidelity_variants.CLASSES[_name] = _cls


def main(argv=None) -> int:
    from sparseserve.bench.fidelity import run_fidelity, write_results
    from sparseserve.bench.fidelity_cli import add_eval_args

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fidelity_shortlist")
    add_eval_args(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", "fidelity"] + argv)
    args.command_line = "python benchmarks/fidelity_shortlist.py " + " ".join(
        shlex.quote(a) for a in argv)
    torch.set_grad_enabled(False)
    out = run_fidelity(args, lambda m: print(m, flush=True),
                       save=lambda o: write_results(o, args.out))
    jpath, mpath = write_results(out, args.out)
    print(f"wrote {jpath} and {mpath}")
    with open(mpath) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
