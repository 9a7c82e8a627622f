"""The command line of EngineArgs: its flags (vLLM names) on an argparse parser, and the
EngineArgs of parsed flags (`EngineArgs.add_cli_args` / `from_cli_args` delegate here)."""
from __future__ import annotations

import argparse
import dataclasses

from sparseserve.config import CUDAGRAPH_MODES
from sparseserve.engine.args import EngineArgs
from sparseserve.engine.presets import PRESETS, preset_help


def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    d = EngineArgs()
    if not model_positional:
        parser.add_argument("--model", default=None,
                            help="HF directory, .gguf file, or built-in dummy config name "
                                 "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", default=d.load_format,
                        choices=["auto", "safetensors", "gguf", "dummy"])
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--dtype", default=d.dtype,
                        choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                        action="store_false")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="a system of the papers' comparison; explicit flags override "
                             "it. " + preset_help())
    parser.add_argument("--layer-segmented-prefill", default=None,
                        action=argparse.BooleanOptionalAction,
                        help="prefill prompts layer by layer across steps (SparseServe)")
    parser.add_argument("--max-inject-tokens", type=int, default=None,
                        help="layer-segmented prefill work per step, in prompt tokens x "
                             "layers (default max-num-batched-tokens x num layers); implies "
                             "--layer-segmented-prefill")
    parser.add_argument("--working-set-control", default=None,
                        action=argparse.BooleanOptionalAction,
                        help="two-tier cache: admit requests while their estimated device "
                             "working sets fit the device cache (default on with "
                             "--kv-offload)")
    parser.add_argument("--working-set-window", type=int, default=d.working_set_window,
                        help="decode steps a working set spans (SparseServe's w)")
    parser.add_argument("--page-size", type=int, default=d.page_size)
    parser.add_argument("--kv-cache-memory-bytes", type=_parse_bytes, default=None,
                        help="device KV slots of each tensor-parallel rank (GPU), e.g. 4G "
                             "or 4294967296; the summaries, metadata and CUDA graph pool "
                             "come on top (default: what gpu_memory_utilization leaves "
                             "after all of them and the rank's weight shard)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=d.gpu_memory_utilization)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--cudagraph-mode", default=d.cudagraph_mode,
                        choices=list(CUDAGRAPH_MODES),
                        help="CUDA graphs (GPU): FULL_DECODE_ONLY captures whole decode "
                             "steps; FULL_AND_PIECEWISE also the layers' attention-free "
                             "pieces of steps with prefill work, per token-count bucket; "
                             "FULL steps with prefill work too (dense attention over device "
                             "pages: whole steps; the sparseserve preset: each layer's "
                             "two-tier work). Default: FULL where it captures something, "
                             "else FULL_DECODE_ONLY")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule and launch the next step while the current one runs "
                             "on the device (while a request uses penalties or a grammar, "
                             "steps run synchronously); one GPU only")
    parser.add_argument("--kv-offload", default=None, action=argparse.BooleanOptionalAction,
                        help="two-tier KV cache: every page in host DRAM, HBM caches the "
                             "pages sparse decode reads")
    parser.add_argument("--kv-offloading-size", type=float, default=None,
                        help="GiB of pinned host memory for the host tier, in total over the "
                             "tensor-parallel ranks (each holds 1/N; default: what "
                             "max-num-seqs x max-model-len needs, at most half the free "
                             "RAM)")
    parser.add_argument("--h2d-method", default=None, choices=["flash", "memcpy"],
                        help="page loads (two-tier cache; default flash)")
    parser.add_argument("--d2h-method", default=None,
                        choices=["flash", "memcpy", "gpu-direct", "copy-engine"],
                        help="page saves (two-tier cache; default flash)")
    parser.add_argument("--eviction", default=None, choices=["category-lru", "lru"],
                        help="device cache eviction (two-tier cache; default category-lru)")
    from sparseserve.sparse import available_algorithms
    parser.add_argument("--sparse-algorithm", default=None,
                        choices=available_algorithms(),
                        help="decode attention: dense (default), or a dynamic sparse "
                             "algorithm")
    parser.add_argument("--token-budget", type=int, default=d.token_budget,
                        help="tokens attended per (request, layer, KV head) in sparse decode")
    parser.add_argument("--sink-pages", type=int, default=d.sink_pages)
    parser.add_argument("--local-pages", type=int, default=d.local_pages)
    parser.add_argument("--dense-layers", type=int, default=d.dense_layers,
                        help="the first N layers keep dense attention")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                        default=d.tensor_parallel_size,
                        help="ranks (one process and GPU each) sharing the model and its "
                             "KV heads; must divide the number of KV heads")


def from_cli_args(cls: type[EngineArgs], args: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))
