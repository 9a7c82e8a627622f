"""Kernel launches per layer of attention in a step with prefill work, counted on the CPU: what
stays eager between the piecewise graphs' pieces (worker/piecewise_graphs.py), so what sets a
hybrid step's host time once the attention-free pieces are captured (issue 12, item 2).

A tiny dummy model (benchmarks/common.py's smoke config) gets a prompt of `--prompt` tokens;
the step that runs its first chunk (`--chunk` tokens, dense: chunked prefill from position 0
on the whole-prompt cuDNN path, here its MATH stand-in) or, with `--continue`, the next chunk
(a prefix in the cache: the paged prefill kernel over its pages) is counted inside the forward
context's attention (in a hybrid step the decode rows replay their own graph first, so only
the prefill rows' attention runs eagerly; `--batch` adds decode rows to this eager count),
with the GPU's code paths forced on CPU tensors (decode_launches.py's counter: Triton
launches by kernel, aten ops that launch a kernel on a GPU). `--preset sparseserve` counts
the two-tier cache's layer-segmented prefill (a whole prompt per segment, every step until its
last layer: the first layer of each step's segment also makes the step's plans).

  TRITON_INTERPRET=1 python benchmarks/prefill_launches.py --preset dense [--continue]
  TRITON_INTERPRET=1 python benchmarks/prefill_launches.py --preset sparseserve --json out.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (CPU: interpreter)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_launches import Counter, count_triton, gpu_paths, patched, report  # noqa: E402


def build(tmp: str, args):
    import common as C
    from sparseserve import LLM

    model, cfg, _ = C.resolve_model(argparse.Namespace(model=None, smoke=True), tmp, 4096)
    if args.layers != cfg["num_hidden_layers"]:  # deeper: what is per step vs per layer
        cfg["num_hidden_layers"] = args.layers
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(cfg, f)
    L, hkv, hd = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    page_bytes = 2 * L * args.page_size * hd * 4 * hkv  # K + V, fp32, one page of every head
    kw = dict(device="cpu", dtype="float32", load_format="dummy", page_size=args.page_size,
              max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=args.chunk + args.batch,
              kv_cache_memory_bytes=args.slots * page_bytes // hkv)
    if args.preset == "sparseserve":
        kw.update(preset="sparseserve", token_budget=args.token_budget, sink_pages=1,
                  local_pages=1, kv_offloading_size=2000 * page_bytes / 2**30)
    llm = LLM(model, **kw)
    runner = llm.engine.runner
    if runner.prefill_attn is None:  # the whole-prompt cuDNN path, its MATH stand-in on CPU
        from torch.nn.attention import SDPBackend

        from sparseserve.worker.prefill_attention import PaddedCausalAttention
        mc = llm.engine.config.model
        runner.prefill_attn = PaddedCausalAttention(
            mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, runner.scale,
            runner.dtype, runner.device, backend=SDPBackend.MATH)
        runner.prefill_attn.warm_up(1024)
    return llm


@contextlib.contextmanager
def counting(counter: Counter, cls):
    """Count inside cls.attention, bucketed by layer. (SDPA's lower-right causal bias is a
    tensor subclass, which cannot be made under a dispatch mode: made outside it, as it
    launches nothing.)"""
    import sparseserve.worker.forward_context as FC
    from torch.utils._python_dispatch import _disable_current_modes

    real, bias = cls.attention, FC.causal_lower_right

    def causal_lower_right(*a):
        with _disable_current_modes():
            return bias(*a)

    def attention(self, layer, q, k, v):
        counter.layer = layer
        try:
            return real(self, layer, q, k, v)
        finally:
            counter.layer = None
    cls.attention, FC.causal_lower_right = attention, causal_lower_right
    try:
        yield
    finally:
        cls.attention, FC.causal_lower_right = real, bias


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="dense", choices=["dense", "sparseserve"])
    p.add_argument("--batch", type=int, default=0,
                   help="requests decoding beside the prompt (counted in the eager attention)")
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--chunk", type=int, default=128, help="token budget of a step")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="count the prompt's second chunk (a prefix in the cache)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=64)
    p.add_argument("--slots", type=int, default=160, help="device slots (pages) per layer")
    p.add_argument("--layers", type=int, default=2,
                   help="layers of the tiny model (the smoke config has 2; more show which "
                        "launches are per step and which per layer)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from sparseserve import SamplingParams
    from sparseserve.worker.forward_context import ForwardContext
    from sparseserve.worker.offload_context import OffloadForwardContext

    # chunks continuing a prefix take the GPU's paged prefill kernel (kernels/paged_prefill.py)
    ForwardContext.paged_prefill_kernel = True
    with tempfile.TemporaryDirectory() as tmp:
        llm = build(tmp, args)
        eng = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for i in range(args.batch):
            ids = [(7 * i + 13 * j) % 2000 + 3 for j in range(40 + 3 * i)]
            eng.add_request(str(i), {"prompt_token_ids": ids}, params)
        for _ in range(20 if args.batch else 0):
            eng.step()
            if all(len(r.output_token_ids) >= 2 for r in eng.scheduler.running):
                break
        eng.add_request("long", {"prompt_token_ids": [(11 * j) % 2000 + 3
                                                      for j in range(args.prompt)]}, params)
        if args.cont:
            eng.step()  # the first chunk
        cache = eng.runner.offload
        cls = ForwardContext if cache is None else OffloadForwardContext
        counter = Counter()
        paths = gpu_paths(counter, cache) if cache is not None else _triton_counted(counter)
        long = eng.scheduler.requests["long"]
        with paths, counter, counting(counter, cls):
            eng.step()
            # layer segments: the prompt's later steps run its later layers
            while args.preset != "dense" and long.num_computed_tokens < args.prompt:
                eng.step()
        if cache is not None:
            cache.check_invariants()
    report(counter, {"preset": args.preset, "continue": args.cont, "args": vars(args)},
           args.json)


@contextlib.contextmanager
def _triton_counted(counter: Counter):
    """Triton launches counted (gpu_paths without the two-tier cache's parts; decode rows,
    if any, keep the CPU decode path)."""
    with patched() as patch:
        count_triton(counter, patch)
        yield


if __name__ == "__main__":
    main()
