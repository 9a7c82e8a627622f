"""Kernels compiled for a GPU target on the CPU (kernels/specialisations.compile_for_cuda:
Triton's front end, GPU passes and ptxas for sm_90, no GPU needed), with the specialisation
each launch of a real call would get: the interpreter that runs the kernel tests in CI executes
kernels as Python, so a kernel that cannot compile passes every interpreted test (the
twenty-second session's layer axis of the fused retrieve reused a loop variable's name with
another type: fine as Python, a compile error on a GPU). Launches are recorded in the
interpreter, compiled in a subprocess out of it. Here the fused retrieve: one layer (a decode
selection: stamps, fresh last pages) and several (a prefill's mapping)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from sparseserve.kernels.specialisations import LaunchRecorder

from tests.kernels.test_retrieve_layers import make_cache, prefill_selection

# on a GPU the kernel tests compile these kernels for real: this file is CI's stand-in for that
pytestmark = [pytest.mark.cpu_only("records launches in Triton's interpreter; on a GPU every "
                                   "kernel test compiles"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                 reason="records launches in Triton's interpreter (CPU CI)")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_in_subprocess(specs: list[dict]) -> str:
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "sparseserve.kernels.specialisations"],
                         input=json.dumps(specs), capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stdout


def test_fused_retrieve_compiles_for_sm90():
    c = make_cache(3, 48, 2)
    pages, num, row, fresh = prefill_selection(c, 17, 2)
    with LaunchRecorder() as rec:
        c.map_prefill_layers(0, 3, pages, num, row, fresh, defer_rebuild=False)
        # a decode step's retrieve of one layer: stamps, a page per head its token starts
        c.retrieve(1, pages[:, :, :5].contiguous(), torch.full_like(num, 5), row,
                   fresh_last=torch.ones(1, dtype=torch.int32), defer_rebuild=True)
    c.close()
    names = {s["name"] for s in rec.specs}
    assert {"_probe_kernel", "_resident_kernel", "_victim_key_kernel", "_place_kernel",
            "_assign_kernel"} <= names
    out = compile_in_subprocess(rec.specs)
    assert sorted(line.split()[0] for line in out.splitlines()) == sorted(
        s["name"] for s in rec.specs)


def test_sparq_kernel4_select_compiles_for_sm90():
    """keycode2-sparq's select with ``sparq_kernel=4`` (sparq_stream's loop in split programs of
    ``page_select.LEAN_WARPS`` warps, then the select launch): both launches compile."""
    from sparseserve.kernels.page_select import LEAN_WARPS

    from tests.kernels.test_sparq_records import _pair
    from tests.kernels.test_sparq_stream import _select

    (new, _), q, table, num, ch = _pair([97, 40], 8, 2, 128, 32, torch.bfloat16, 5)
    with LaunchRecorder() as rec:
        _select(new[0].views(new[1]), q, table, num, ch, 4, splits=3)
    score = [s for s in rec.specs if s["name"] == "_page_select_kernel"
             and s["constexprs"][str(list(s["signature"]).index("DO_SCORE"))]
             and not s["constexprs"][str(list(s["signature"]).index("DO_SELECT"))]]
    assert len(score) == 1 and score[0]["options"].get("num_warps") == LEAN_WARPS
    assert score[0]["constexprs"][str(list(score[0]["signature"]).index("SPARQ"))] == 4
    out = compile_in_subprocess(rec.specs)
    assert sorted(line.split()[0] for line in out.splitlines()) == sorted(
        s["name"] for s in rec.specs)


def test_sparq_lanes_select_compiles_for_sm90():
    """keycode2-sparq's default select on CUDA (``sparq_kernel=5``: ``sparq_lanes``' inline
    PTX, which the interpreter emulates instead of compiling): its split score launch (4
    warps) and a fused launch of 8 warps compile for sm_90 with the GPU path on (FAST)."""
    from tests.kernels.test_sparq_records import _pair
    from tests.kernels.test_sparq_stream import _select

    (new, _), q, table, num, ch = _pair([97, 40], 8, 2, 128, 32, torch.bfloat16, 5)
    with LaunchRecorder() as rec:
        _select(new[0].views(new[1]), q, table, num, ch, 5, splits=3)
        _select(new[0].views(new[1]), q, table, num, ch, 5, splits=1, warps=8)
    specs = [s for s in rec.specs if s["name"] == "_page_select_kernel"]
    for s in specs:
        names = list(s["signature"])
        assert s["constexprs"][str(names.index("SPARQ"))] == 5
        s["constexprs"][str(names.index("FAST"))] = True  # the GPU path: inline PTX
    assert {s["options"].get("num_warps") for s in specs} >= {4, 8}
    out = compile_in_subprocess(specs)
    assert sorted(line.split()[0] for line in out.splitlines()) == sorted(
        s["name"] for s in specs)
