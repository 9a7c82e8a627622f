"""Kernel launches per layer of the offloaded sparse decode step (preset `sparseserve`), counted
on the CPU: the instrument for the launch count of the CUDA-graph decode step (on a GPU each
tiny kernel of the graph costs ~2-4 us plus ~1-2 us of gap, so the count is most of the
offloaded step's overhead over dense).

A tiny dummy model (benchmarks/common.py's smoke config: llama-3-8b widths cut to 2 layers)
runs a few requests through prefill, then one decode step is counted with the GPU's code path
forced on CPU tensors (Triton kernels in the interpreter: the fused retrieve, FlashH2D, the
slot store, paged decode and selection kernels). Counted per layer,
inside OffloadForwardContext.attention (what the offloaded decode adds to a layer: save,
select, retrieve, store, index, attend):

* Triton launches (one per kernel call), by kernel name;
* aten ops that launch a kernel on a GPU (views, empty tensors and other metadata ops do
  not), by op name — torch.cumsum of a 1-D tensor is two kernels on CUDA (CUB's init + scan)
  but one op here.

Layer 0 also computes the step's per-layer-independent plan (OffloadForwardContext.
_decode_plan); in a CUDA graph every layer replays its own launches, so the per-layer cost is
that of layers >= 1, the plan's once per step. Not counted (once per step, after the layers:
OffloadForwardContext.finish_layers): the residency indexes' rebuild-if-full for every layer
(three launches) and the decode rows' DRAM write-through (one GPU-direct launch).

  TRITON_INTERPRET=1 python benchmarks/decode_launches.py [--fills] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (CPU: interpreter)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten ops that never launch a device kernel (metadata, allocation without a fill)
NO_KERNEL = {"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze",
             "transpose", "t", "permute", "as_strided", "alias", "detach", "empty",
             "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
             "_reshape_alias", "split", "split_with_sizes", "unbind", "view_as_real",
             "_to_copy_noop", "sym_size", "sym_stride", "sym_numel", "is_same_size",
             "diagonal", "unfold", "narrow", "chunk", "set_", "resize_"}


def _aliases(out, args) -> bool:
    """The op returned (views of) its inputs: no kernel. Under inference mode composite ops
    (to, reshape, contiguous) reach the dispatch mode whole, also when they copy nothing."""
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor)]
    if any(t.is_mkldnn for t in outs) or any(isinstance(a, torch.Tensor) and a.is_mkldnn
                                             for a in args):
        return False  # the CPU's prepacked weights (no storage): a kernel-launching op
    ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return bool(outs) and all(t.untyped_storage().data_ptr() in ins for t in outs)


class Counter(TorchDispatchMode):
    """aten ops (kernel-launching ones) and Triton launches, bucketed by the current layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: int | None = None
        self.in_triton = 0
        self.ops: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.layer is not None and not self.in_triton:
            name = func.overloadpacket.__name__
            if name not in NO_KERNEL and (func._schema.is_mutable or not _aliases(out, args)):
                self.ops[self.layer]["aten." + name] += 1
        return out

    def triton(self, name: str) -> None:
        if self.layer is not None:
            self.ops[self.layer]["triton." + name] += 1


@contextlib.contextmanager
def patched():
    """-> patch(obj, name, value): set attributes for the block, restored after it."""
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)
    try:
        yield patch
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def count_triton(counter: Counter, patch) -> None:
    """Count every Triton launch (compiled or interpreted) in `counter`, by kernel name."""
    from triton.runtime import interpreter, jit

    for cls in (interpreter.InterpretedFunction, jit.JITFunction):
        run = cls.run

        def counted(self, *a, _run=run, **kw):
            counter.triton(getattr(self.fn, "__name__", str(self.fn)))
            counter.in_triton += 1
            try:
                return _run(self, *a, **kw)
            finally:
                counter.in_triton -= 1
        patch(cls, "run", counted)


@contextlib.contextmanager
def gpu_paths(counter: Counter, cache):
    """Force the GPU's dispatch on CPU tensors and count Triton launches."""
    import sparseserve.kernels as K
    import sparseserve.worker.offload_context as OC

    with patched() as patch:
        resolve = K.resolve_backend
        patch(K, "resolve_backend", lambda backend, t: "triton" if backend in (None, "auto")
              else resolve(backend, t))
        pda = K.paged_decode_attention
        patch(OC, "paged_decode_attention",
              lambda *a, **kw: pda(*a, **{**kw, "backend": "triton"}))
        count_triton(counter, patch)
        cache.fused = True
        patch(cache.loader, "backend", "triton")
        yield


def build(tmp: str, args):
    import common as C
    from sparseserve import LLM

    model, cfg, _ = C.resolve_model(argparse.Namespace(model=None, smoke=True), tmp, 4096)
    L, hkv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    hd = cfg["head_dim"]
    page_bytes = 2 * L * args.page_size * hd * 4 * hkv  # K + V, fp32, one page of every head
    llm = LLM(model, preset="sparseserve", device="cpu", dtype="float32", load_format="dummy",
              page_size=args.page_size, token_budget=args.token_budget, sink_pages=1,
              local_pages=1, max_num_seqs=8, max_model_len=1024,
              kv_cache_memory_bytes=args.slots * page_bytes // hkv,
              kv_offloading_size=2000 * page_bytes / 2**30)
    return llm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=64)
    p.add_argument("--slots", type=int, default=40, help="device slots per layer")
    p.add_argument("--fills", action="store_true",
                   help="count a step whose tokens may fill a page (decode_fills=True)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from sparseserve import SamplingParams
    from sparseserve.worker.offload_context import OffloadForwardContext

    with tempfile.TemporaryDirectory() as tmp:
        llm = build(tmp, args)
        eng = llm.engine
        cache = eng.runner.offload
        for i in range(args.batch):
            ids = [(7 * i + 13 * j) % 2000 + 3 for j in range(args.prompt + 3 * i)]
            eng.add_request(str(i), {"prompt_token_ids": ids},
                            SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        for _ in range(50):  # prefill (and a decode step or two)
            eng.step()
            if all(len(r.output_token_ids) >= 2 for r in eng.scheduler.running):
                break
        counter = Counter()
        real = OffloadForwardContext.attention
        fills_seen = []

        def attention(self, layer, q, k, v):
            if args.fills:
                self.decode_fills = True
            fills_seen.append(self.decode_fills)
            counter.layer = layer
            try:
                return real(self, layer, q, k, v)
            finally:
                counter.layer = None
        OffloadForwardContext.attention = attention
        try:
            with gpu_paths(counter, cache), counter:
                eng.step()
        finally:
            OffloadForwardContext.attention = real
        cache.check_invariants()
    report(counter, {"decode_fills": fills_seen[0] if fills_seen else None}, args.json)


def report(counter: Counter, head: dict, json_path: str | None) -> None:
    """Print launches per layer (and the last layer's by name); write them with `head` as
    JSON when json_path is given."""
    layers = sorted(counter.ops)
    res = dict(head, per_layer={str(layer): sum(counter.ops[layer].values()) for layer in layers},
               ops={str(layer): dict(sorted(counter.ops[layer].items())) for layer in layers})
    for layer in layers:
        c = counter.ops[layer]
        print(f"layer {layer}: {sum(c.values())} launches "
              f"({sum(v for n, v in c.items() if n.startswith('triton.'))} Triton)")
    for name, n in sorted((counter.ops[layers[-1]] if layers else {}).items()):
        print(f"  {n:3d}  {name}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
