"""Registers, spills and occupancy of a sparse algorithm's select kernels on the H200, without a
GPU: the launches are captured on the CPU (Triton's interpreter, nothing executed) at the
benchmark's shape, then compiled for sm_90 by Triton's own compiler (ptxas ships with Triton)
with the GPU path's argument types and constants, and their cubins read with cuobjdump.

Why: `sparse_decode.py` measured keycode2-sparq's select at 13 % of copy bandwidth on the H200
(sparse.md, twentieth session) — latency-bound, not byte-bound. Warps in flight per SM (what
hides the latency of its scattered record loads) are set by the registers per thread, the
warps per program and the programs per row (splits); this script says which combination the
kernel compiles to, so the device time goes to the variants worth timing.

  python benchmarks/select_occupancy.py --out /tmp/occ.json                  # keycode2-sparq
  python benchmarks/select_occupancy.py --out /tmp/occ.json --num-warps 4,8 --maxnreg 0,128,96
  python benchmarks/select_occupancy.py --out /tmp/occ.json --sass-stats \
      --algorithm keycode2-sparq@score_kernel=4    # + the score loop's SASS per page

``--sass-stats`` reads the score loop of a split score launch out of the SASS (the longest
span closed by a backward branch; fused launches, whose select phase loops too, are left out)
and counts its instructions, barriers, shared-memory and global accesses, shuffles and
mma; per page = per warp and loop iteration / the pages of one iteration (``BLOCK_W``: 16 for
``sparq_stream``, score_kernel 3 and 4; 64 for ``sparq_tiles``; ``sparq_lanes``, score_kernel
5, the GPU's default: 16 pages a warp, its warps' iterations are not shared, so the program's
warp-instructions per page are the warp's). Launches are captured on the CPU, where the
default score phase is kernel 3: pass ``@score_kernel=5`` for the GPU's. Issue slots, not time; the
barriers (where a program's warps wait for each other's loads) and the shared-memory round
trips are what redesigns of the score phase aim to remove (sparse.md).

Occupancy here is the register and shared-memory limit per SM (64 warps, 65,536 registers,
228 KiB of shared memory on sm_90), capped by the programs the grid gives each of 132 SMs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMS, WARPS_PER_SM, REGS_PER_SM, SMEM_PER_SM = 132, 64, 65536, 228 * 1024
# the GPU path's operand types and constants where the CPU wrapper differs (it upcasts bf16
# for the interpreter's dot, has no PTX and no lg2.approx)
GPU_TYPES = {"q_ptr": "*bf16", "kmin_ptr": "*bf16", "kmax_ptr": "*bf16"}
GPU_CONSTANTS = {"DOT_PREC": "tf32", "ASM": True, "FAST": True}


def capture(args) -> list[dict]:
    """In a child process under TRITON_INTERPRET=1: the select's launches (kernel, grid,
    options, every argument's specialisation), none of them run."""
    code = f"""
import json, sys
sys.path.insert(0, {ROOT!r})
import torch
import inspect
import sparseserve.kernels.page_select as ps_mod
from sparseserve.kernels.specialisations import SpecialisationLog, _is_constexpr
from sparseserve.sparse import get_algorithm_class
from triton.runtime.interpreter import InterpretedFunction
# the split heuristic as on the GPU's SM count (the CPU's stand-in is 8)
ps_mod.CPU_SMS = {SMS}
log, caps = SpecialisationLog(), []
def run(self, *a, grid, warmup, **kw):
    sig = inspect.signature(self.fn)
    key = log.key(self.fn, self.kwargs, a, kw)  # (name, type, alignment / value repr) ...
    bound = sig.bind(*a, **{{k: v for k, v in kw.items() if k in sig.parameters}})
    bound.apply_defaults()
    # constexprs (declared, or an int Triton specialises as one: == 1, None) keep their value
    args = [[n, "constexpr", bound.arguments[n]] if _is_constexpr(p) or e[1] == "constexpr"
            else list(e) for (n, p), e in zip(sig.parameters.items(), key)]
    caps.append(dict(module=self.fn.__module__, name=self.fn.__name__, grid=list(grid),
                     args=args, options={{k: v for k, v in kw.items()
                                         if k in ("num_warps", "num_stages")}}))
InterpretedFunction.run = run
P, ps, d, hkv, g, B = 512, {args.page_size}, 128, 8, 4, {args.batch}
W = -(-{args.context} // ps)
name, _, variant = {args.algorithm!r}.partition("@")
alg = get_algorithm_class(name)(ps, {args.token_budget} // ps, 1, 2)
for item in filter(None, variant.split("+")):
    k, _, v = item.partition("=")
    setattr(alg, k, int(v))
summ = alg.make_summaries(P + 1, d, torch.bfloat16, "cpu")
alg.index(torch.randn(P, ps, d).to(torch.bfloat16), torch.arange(P, dtype=torch.int32),
          torch.full((P,), ps, dtype=torch.int32), summ, None)
caps.clear()
q = torch.randn(B, hkv * g, d).to(torch.bfloat16)
pt = torch.randint(0, P, (B, hkv, W), dtype=torch.int32)
alg.select_kernel(q, pt, torch.full((B, hkv), W, dtype=torch.int32),
                  torch.full((B,), ps, dtype=torch.int32), summ, backend="triton")
print(json.dumps(caps))
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"capturing the launches failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


LOOP_OPS = ("BAR.SYNC", "LDS", "STS", "LDSM", "LDGSTS", "LDG", "STG", "SHFL", "HMMA", "MUFU",
            "I2F", "F2FP", "PRMT", "LOP3", "FFMA", "FADD", "FMNMX")


def loop_stats(sass: str, pages: int, num_warps: int) -> dict:
    """The longest loop of a SASS listing (from a backward branch's target to the branch):
    its instructions per warp and iteration, per page (``pages`` an iteration of the program:
    ``per_page`` per warp, ``warp_inst_per_page`` summed over the program's ``num_warps``)
    and the count of each opcode family of ``LOOP_OPS`` (``LDS`` counts LDS.*, not LDSM)."""
    inst = [(int(m.group(1), 16), m.group(2).strip()) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for addr, text in inst:
        tgt = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if tgt and int(tgt.group(1), 16) < addr:
            span = (int(tgt.group(1), 16), addr)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        return {}
    body = [t for a, t in inst if best[0] <= a <= best[1]]
    ops = [re.sub(r"^@!?U?P[T0-9]+\s+", "", t).split()[0] for t in body]
    out = dict(loop_instructions=len(body), loop_pages=pages,
               per_page=round(len(body) / pages, 1),
               warp_inst_per_page=round(len(body) * num_warps / pages, 1))
    for op in LOOP_OPS:  # "LDS" matches LDS and LDS.*, not LDSM
        out[op] = sum(o == op or o.startswith(op + ".") for o in ops)
    return out


def compile_launch(cap: dict, num_warps: int | None, maxnreg: int,
                   sass_stats: bool = False) -> dict:
    """Compile one captured launch for sm_90 -> registers, spill bytes, shared memory,
    SASS instructions and the warps per SM it can keep in flight."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(cap["module"]), cap["name"])
    gpu = cap["name"] == "_page_select_kernel"
    sig, consts, attrs = {}, {}, {}
    for i, (name, kind, spec) in enumerate(cap["args"]):
        if kind == "constexpr":
            sig[name] = "constexpr"
            consts[(i,)] = GPU_CONSTANTS.get(name, spec) if gpu else spec
        else:
            sig[name] = GPU_TYPES.get(name, kind) if gpu else kind
            if spec == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(cap["options"])
    if num_warps:
        options["num_warps"] = num_warps
        if "NW" in sig:
            consts[(list(sig).index("NW"),)] = num_warps
    if maxnreg:
        options["maxnreg"] = maxnreg
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    nw = options.get("num_warps", 4)
    smem = kernel.metadata.shared
    programs = 1
    for g in cap["grid"]:
        programs *= g
    per_sm = min(REGS_PER_SM // (regs * 32 * nw), SMEM_PER_SM // smem if smem else 64,
                 WARPS_PER_SM // nw, -(-programs // SMS))
    row = dict(kernel=cap["name"], grid=cap["grid"], num_warps=nw, maxnreg=maxnreg,
               registers=regs, spill_bytes=stack, shared_bytes=smem,
               sass_instructions=sass.count(";"), programs_per_sm=per_sm,
               warps_per_sm=per_sm * nw)
    const = {name: spec for name, kind, spec in cap["args"] if kind == "constexpr"}
    # split score launches only: in a fused launch (DO_SELECT too) the longest loop may be the
    # select phase's, not the score loop
    if sass_stats and const.get("DO_SCORE") and not const.get("DO_SELECT") \
            and const.get("SPARQ", 0) >= 2:
        # sparq_lanes (5): each warp's loop scores its own BLOCK_W pages (the others' warps
        # share an iteration's pages)
        row.update(loop_stats(sass, const["BLOCK_W"], 1 if const["SPARQ"] == 5 else nw))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--algorithm", default="keycode2-sparq",
                    help="registered algorithm, variants as in sparse_decode.py (@key=value+...)")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--num-warps", default="0", help="comma list; 0 = the launch's own")
    ap.add_argument("--maxnreg", default="0", help="comma list of register caps; 0 = none")
    ap.add_argument("--sass-stats", action="store_true",
                    help="count the score loop's SASS (instructions per page, BAR.SYNC, LDS ...)")
    args = ap.parse_args()
    caps = capture(args)
    rows = []
    for cap in caps:
        for nw in map(int, args.num_warps.split(",")):
            for mr in map(int, args.maxnreg.split(",")):
                rows.append(compile_launch(cap, nw or None, mr, args.sass_stats))
    with open(args.out, "w") as f:
        json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)
    cols = ["kernel", "grid", "num_warps", "maxnreg", "registers", "spill_bytes",
            "shared_bytes", "sass_instructions", "programs_per_sm", "warps_per_sm"]
    print("  ".join(cols))
    for r in rows:
        print("  ".join(str(r[c]) for c in cols))
    for r in rows:
        if "loop_instructions" in r:
            print(f"{r['kernel']} {r['grid']} score loop: " + "  ".join(
                f"{k}={r[k]}" for k in ("loop_instructions", "loop_pages", "per_page",
                                        "warp_inst_per_page")
                + LOOP_OPS))


if __name__ == "__main__":
    main()
