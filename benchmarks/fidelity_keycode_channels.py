"""`sparseserve eval fidelity` with evaluation variants of the channel key codes registered
(``sparse/keycode_channels.py``; the CLI knows only the engine's algorithms):

* ``keycode2-c4-var`` / ``keycode2-c8-var`` — the coded channels chosen by within-page
  variance instead of width (max - min);
* ``keycode2-c4-q`` — chosen by within-page variance times the energy of the page's filling
  queries (rotate-half pairs summed), the query-aware estimate of the logit error removed;
* ``keycode2-c4-i8`` / ``keycode2-c8-i8`` — the page mean stored as int8 times a per-page
  absmax scale (D + 4 bytes instead of 2 D at bf16).

They are real algorithms with their own summaries (registered here, evaluated like any other,
fast mode through ``KeyCodes.approx_keys``).

    nice -n 5 python benchmarks/fidelity_keycode_channels.py --lengths 8192 --budgets 512 2048 \\
        --algorithms keycode2-c4 keycode2-c4-var keycode2-c4-i8 --num-texts 2 --tail 256 \\
        --sweep-algorithms keycode2-c4 --sweep-settings s1l2d0 --no-needle --no-plot --out OUT
"""
from __future__ import annotations

import sys

from sparseserve.bench import fidelity_cli
from sparseserve.sparse.base import register
from sparseserve.sparse.keycode_channels import KeyCodeChannels

register("keycode2-c4-q")(type("KeyCode2C4Query", (KeyCodeChannels,),
                              {"channel_divisor": 4, "choose_by": "query", "uses_queries": True}))
for _div in (4, 8):
    register(f"keycode2-c{_div}-var")(type(f"KeyCode2C{_div}Var", (KeyCodeChannels,),
                                           {"channel_divisor": _div, "choose_by": "var"}))
    register(f"keycode2-c{_div}-i8")(type(f"KeyCode2C{_div}I8", (KeyCodeChannels,),
                                          {"channel_divisor": _div, "int8_mean": True}))


def main(argv=None) -> int:
    return fidelity_cli.main(["fidelity"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
