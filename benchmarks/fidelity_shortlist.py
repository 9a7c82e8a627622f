"""`sparseserve eval fidelity` with evaluation variants of the key-code shortlist
(``sparse/keycode_shortlist.py``) registered — diagnostics of where the shortlist loses
answers, not engine code:

* ``keycode2-sl-allnorm`` / ``keycode2-sl2-allnorm`` — the shortlist's pages (the box top-S,
  S = 4 / 2 x budget), but each head's code-mass softmax over *every* full page, as keycode2
  normalises (so it reads every page's codes: no saving). Equal to keycode2 where the
  shortlist holds keycode2's choice; the gap to the shortlist algorithm is what normalising
  over the shortlist costs, the gap to keycode2 what the box shortlist misses.

* ``keycode2-sl8`` — the shortlist at S = 8 x budget (how the loss shrinks with S).
* ``keycode2-sl-max`` / ``keycode2-sl2-max`` — stage 1 ranks pages by the *max* over the GQA
  group's heads of each head's box mass (not the sum): every head's favourites compete
  equally. Same bytes.
* ``keycode2-sl-ark`` / ``keycode2-sl2-ark`` — stage 1 bounds each page by ArkVale's tighter
  box (centre ± the mean |key - centre| per channel, a second pair of vectors stored beside
  keycode2's: registered here, summaries 12.5 % of the KV bytes); stage 2 as keycode2-sl.

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
from sparseserve.kernels.ref import mass_from_bounds, select_from_scores
from sparseserve.sparse.base import register
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


class MaxOverHeads:
    """Stage 1 by the max over the group's heads of each head's box mass."""

    def shortlist(self, box_bounds, num_pages, scale):
        G = box_bounds.shape[2]
        mass = torch.stack([mass_from_bounds(box_bounds[:, :, g:g + 1], num_pages,
                                             self.sink_pages, self.local_pages, scale)
                            for g in range(G)]).amax(0)
        B, Hkv, W = mass.shape
        blk = torch.arange(W).expand(B, Hkv, W)
        _, num, blocks = select_from_scores(mass, blk, num_pages, self.shortlist_pages,
                                            self.sink_pages, self.local_pages, stable=True)
        ok = torch.arange(blocks.shape[-1]).view(1, 1, -1) < num.long()[..., None]
        m = torch.zeros(B, Hkv, W + 1, dtype=torch.bool)
        return m.scatter_(2, torch.where(ok, blocks, W), True)[..., :W]


class KeyCode2ShortlistMax(MaxOverHeads, KeyCode2Shortlist):
    pass


class KeyCode2Shortlist2Max(MaxOverHeads, KeyCode2Shortlist2):
    pass


class ArkBox:
    """Stage 1 on ArkVale's box, stored beside keycode2's summaries."""

    summary_names = ("kmin", "kmax", "codes", "akmin", "akmax")

    def summary_shapes(self, head_dim):
        return {**super().summary_shapes(head_dim), "akmin": (head_dim,), "akmax": (head_dim,)}

    def index(self, k_cache, page_ids, num_tokens, summaries, queries):
        super().index(k_cache, page_ids, num_tokens, summaries, queries)
        live = page_ids >= 0
        rows = torch.where(live, page_ids, summaries["kmin"].shape[0] - 1).long()
        k = k_cache[torch.where(live, page_ids, 0).long()].float()         # [N, ps, D]
        ok = torch.arange(k.shape[1]).view(1, -1, 1) < num_tokens.view(-1, 1, 1)
        c = (summaries["kmin"][rows].float() + summaries["kmax"][rows].float()) * 0.5
        r = torch.where(ok, (k - c.unsqueeze(1)).abs(), 0.0).sum(1) \
            / num_tokens.clamp(min=1).view(-1, 1).float()
        summaries["akmin"][rows] = (c - r).to(summaries["akmin"].dtype)
        summaries["akmax"][rows] = (c + r).to(summaries["akmax"].dtype)

    def shortlist_box(self, summaries):
        return summaries["akmin"], summaries["akmax"]


@register("keycode2-sl-ark")
class KeyCode2ShortlistArk(ArkBox, KeyCode2Shortlist):
    pass


@register("keycode2-sl2-ark")
class KeyCode2Shortlist2Ark(ArkBox, KeyCode2Shortlist2):
    pass


class KeyCode2Shortlist8(KeyCode2Shortlist):
    shortlist_factor = 8


for _name, _base, _cls in (("keycode2-sl8", "keycode2-sl", KeyCode2Shortlist8),
                           ("keycode2-sl-max", "keycode2-sl", KeyCode2ShortlistMax),
                           ("keycode2-sl2-max", "keycode2-sl2", KeyCode2Shortlist2Max)):
    fidelity_variants.VARIANTS[_name] = _base
    fidelity_variants.CLASSES[_name] = _cls


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
