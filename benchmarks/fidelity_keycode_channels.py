"""`sparseserve eval fidelity` with evaluation variants of the channel key codes registered
(``sparse/keycode_channels.py``; the CLI knows only the engine's algorithms):

* ``keycode2-c4-var`` / ``keycode2-c8-var`` — the coded channels chosen by within-page
  variance instead of width (max - min);
* ``keycode2-c4-q`` — chosen by within-page variance times the energy of the page's filling
  queries (rotate-half pairs summed), the query-aware estimate of the logit error removed;
* ``keycode2-c4-f`` / ``keycode2-c8-f`` — the page mean in the KV dtype (2 D bytes at bf16)
  instead of int8 times a per-page absmax scale (D + 4 bytes). Until 2026-12-03 the
  registered keycode2-c4 / -c8 had the float mean and this variant was the int8 one, named
  ``-i8``: the JSON rows of docs/results/data/fidelity_keycode_channels_*.json carry the old
  names (``keycode2-c4`` = float mean, ``keycode2-c4-i8`` = today's keycode2-c4).

They are real algorithms with their own summaries (registered here, evaluated like any other,
fast mode through ``KeyCodes.approx_keys``).

    nice -n 5 python benchmarks/fidelity_keycode_channels.py --lengths 8192 --budgets 512 2048 \\
        --algorithms keycode2-c4 keycode2-c4-var keycode2-c4-f --num-texts 2 --tail 256 \\
        --sweep-algorithms keycode2-c4 --sweep-settings s1l2d0 --no-needle --no-plot --out OUT
"""
from __future__ import annotations

import sys

import torch

from sparseserve.bench import fidelity_cli
from sparseserve.sparse.base import register
from sparseserve.sparse.keycode_channels import KeyCodeChannels


class ByVariance(KeyCodeChannels):
    def channel_worth(self, k, ok, mean, width, queries):
        """The within-page variance of each channel."""
        return torch.where(ok, (k - mean.unsqueeze(1)) ** 2, 0.0).sum(1)


class ByQueryEnergy(ByVariance):
    uses_queries = True

    def channel_worth(self, k, ok, mean, width, queries):
        """Variance x the query energy there, estimated from the queries that filled the page
        (rotate-half RoPE turns channel c with c + D/2: their summed energy is the
        position-free part): the expected squared logit error a channel's codes remove."""
        var = super().channel_worth(k, ok, mean, width, queries)
        if queries is None:
            return var
        qe = queries.float().pow(2).sum(1)                            # [N, D]
        return var * (qe + qe.roll(k.shape[-1] // 2, dims=1))


register("keycode2-c4-q")(type("KeyCode2C4Query", (ByQueryEnergy,), {"channel_divisor": 4}))
for _div in (4, 8):
    register(f"keycode2-c{_div}-var")(type(f"KeyCode2C{_div}Var", (ByVariance,),
                                           {"channel_divisor": _div}))
    register(f"keycode2-c{_div}-f")(type(f"KeyCode2C{_div}Float", (KeyCodeChannels,),
                                         {"channel_divisor": _div, "int8_mean": False}))


def main(argv=None) -> int:
    return fidelity_cli.main(["fidelity"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
