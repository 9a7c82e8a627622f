"""EngineArgs: the user's knobs (vLLM names) -> a frozen, checked EngineConfig (its command
line: engine/cli_args.py; its checks of knob combinations: engine/args_checks.py)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from sparseserve.config import (HOST_CHUNK_PAGES, CacheConfig, EngineConfig, LoadConfig,
                                ModelConfig, ParallelConfig, SchedulerConfig, SparseConfig)
from sparseserve.engine.memory_plan import (DTYPE_BYTES, GiB, check_plan, fit_num_pages,
                                            gpu_memory, kv_page_bytes, plan_memory)
from sparseserve.engine.args_checks import EngineArgsChecks
from sparseserve.engine.presets import OFFLOAD_ONLY, apply_preset

logger = logging.getLogger("sparseserve")

CPU_DEFAULT_KV_BYTES = 2 * GiB


@dataclass
class EngineArgs(EngineArgsChecks):
    model: str | None = None
    load_format: str = "auto"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # None = set by the preset (engine/presets.py), else the base default
    preset: str | None = None
    layer_segmented_prefill: bool | None = None
    max_inject_tokens: int | None = None  # layer-segmented prefill work per step (tokens x layers)
    working_set_control: bool | None = None
    working_set_window: int = 12
    page_size: int = 32
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    enforce_eager: bool = False
    # vLLM's names: FULL_DECODE_ONLY (whole decode steps), FULL_AND_PIECEWISE (also the
    # attention-free pieces of steps with prefill work: worker/piecewise_graphs.py), FULL (steps
    # with prefill work captured too). None: FULL where this configuration captures its steps
    # with prefill work (dense attention over device pages, or the sparseserve preset's
    # two-tier layer graphs), else FULL_DECODE_ONLY (_default_graph_mode)
    cudagraph_mode: str | None = None
    # schedule and launch step N + 1 while step N runs on the device (worker/pending_step.py)
    async_scheduling: bool = False
    kv_offload: bool | None = None
    kv_offloading_size: float | None = None  # GiB of host DRAM for the host tier
    h2d_method: str | None = None
    d2h_method: str | None = None
    eviction: str | None = None
    sparse_algorithm: str | None = None
    token_budget: int = 2048
    sink_pages: int = 1
    local_pages: int = 2  # chosen by the fidelity measurement (docs/results/fidelity.md)
    dense_layers: int = 0
    # ranks that each hold 1/N of the model and of the KV heads (kv_cache_memory_bytes is per
    # rank, kv_offloading_size the total, as in vLLM)
    tensor_parallel_size: int = 1

    # ---- CLI (engine/cli_args.py) ---------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
        from sparseserve.engine.cli_args import add_cli_args
        add_cli_args(parser, model_positional)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        from sparseserve.engine.cli_args import from_cli_args
        return from_cli_args(cls, args)

    # ---- resolution -----------------------------------------------------------------------
    def resolved(self) -> "EngineArgs":
        """A copy with the preset applied (every preset-controlled knob set); raises for
        flags that would do nothing in the chosen configuration."""
        given = {k: getattr(self, k) for k in
                 ("sparse_algorithm", "kv_offload", "h2d_method", "d2h_method", "eviction",
                  "working_set_control", "layer_segmented_prefill")}
        if self.max_inject_tokens is not None and self.layer_segmented_prefill is None:
            given["layer_segmented_prefill"] = True
        values = apply_preset(self.preset, given)
        if not values["kv_offload"]:
            useless = [k for k in OFFLOAD_ONLY if getattr(self, k) is not None]
            if useless:
                flags = ", ".join("--" + k.replace("_", "-") for k in useless)
                raise ValueError(f"{flags} only act on the two-tier cache; add --kv-offload "
                                 "(or --preset sparseserve / sparse-offload) or drop them.")
        if values["layer_segmented_prefill"] is False and self.max_inject_tokens is not None:
            raise ValueError("max_inject_tokens is the budget of layer-segmented prefill, "
                             "which is off; drop it or enable layer_segmented_prefill.")
        if values["working_set_control"] is None:
            values["working_set_control"] = bool(values["kv_offload"])
        values["layer_segmented_prefill"] = bool(values["layer_segmented_prefill"])
        return dataclasses.replace(self, **values)

    def create_engine_config(self):
        """-> (EngineConfig, ModelSource). Validates everything before any weight is loaded."""
        return self.resolved()._build_config()

    def _build_config(self):
        import torch

        from sparseserve.model.loader import load_model_config, resolve_model_source

        source = resolve_model_source(self.model, self.load_format)
        mc = load_model_config(source)
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA GPU is visible; use device='cpu'.")
        dtype = _resolve_dtype(self.dtype, device, mc)
        tp = self._check_parallel(mc, device)
        self._check_graph_mode(device, tp)
        mc_rank = dataclasses.replace(mc, num_key_value_heads=mc.num_key_value_heads // tp)
        if self.page_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"page_size must be one of 8, 16, 32, 64, 128; got {self.page_size}.")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1.")
        if self.max_inject_tokens is not None and self.max_inject_tokens < 1:
            raise ValueError("max_inject_tokens must be >= 1 (or unset).")
        if self.working_set_window < 1:
            raise ValueError("working_set_window must be >= 1 decode step.")

        page_bytes = 2 * mc.num_hidden_layers * self.page_size * mc.head_dim * DTYPE_BYTES[dtype]
        num_host_pages = self._host_pages(page_bytes, mc_rank, tp)
        mc_full = mc

        def draft(num_pages: int) -> EngineConfig:
            # the config the memory plan sizes the slots with, before max_model_len is
            # known: the longest it can be (the plan only shrinks with it)
            max_len = self.max_model_len or min(
                mc_full.max_position_embeddings,
                mc_full.sliding_window or mc_full.max_position_embeddings)
            return self._assemble(source, mc_full, device, dtype, tp, num_pages,
                                  num_host_pages, num_pages * page_bytes, max_len,
                                  self._sparse_config(mc_rank))

        kv_bytes, budget = self._kv_bytes(device, tp, draft)
        num_pages = kv_bytes // page_bytes
        mc = mc_rank  # page counts below are per rank, over its KV heads
        pool = num_host_pages if self.kv_offload else num_pages
        chunk = HOST_CHUNK_PAGES if self.kv_offload else 1  # pages come in whole chunks
        capacity_tokens = (pool // chunk // mc.num_key_value_heads) * chunk * self.page_size
        if capacity_tokens < self.page_size:
            if self.kv_offload:
                need = page_bytes * chunk * mc.num_key_value_heads
                raise ValueError(f"The host tier ({num_host_pages * page_bytes} bytes) holds no "
                                 f"chunk of pages per KV head ({need} bytes); raise "
                                 "kv_offloading_size.")
            raise ValueError(f"KV cache of {kv_bytes} bytes holds no full page set "
                             f"({page_bytes * mc.num_key_value_heads} bytes); raise "
                             "kv_cache_memory_bytes / gpu_memory_utilization.")
        max_len = self.max_model_len
        if max_len is None:
            max_len = min(mc.max_position_embeddings, capacity_tokens,
                          mc.sliding_window or capacity_tokens)
            if self.kv_offload:  # a prompt being prefilled keeps its pages in slots
                max_len = min(max_len, num_pages // mc.num_key_value_heads * self.page_size)
        elif max_len > mc.max_position_embeddings and source.kind != "dummy":
            raise ValueError(f"max_model_len={max_len} exceeds the model's context length "
                             f"({mc.max_position_embeddings}); the model was not trained for it. "
                             "Lower max_model_len (dummy weights for benchmarks may exceed it).")
        elif max_len > capacity_tokens:
            raise ValueError(f"max_model_len={max_len} needs more KV cache than the "
                             f"{capacity_tokens} tokens that fit in {kv_bytes} bytes; raise "
                             "kv_cache_memory_bytes or lower max_model_len.")
        if max_len < 1:
            raise ValueError("max_model_len must be >= 1.")
        if mc.sliding_window is not None and max_len > mc.sliding_window:
            # attention here is full: beyond the window the model would see more than trained
            raise ValueError(f"This model uses sliding-window attention ({mc.sliding_window} "
                             "tokens), which sparseserve does not implement; set max_model_len "
                             f"<= {mc.sliding_window}.")
        sparse = self._sparse_config(mc)
        if self.kv_offload:
            self._check_offload(sparse, mc, num_pages, max_len, self._inject_tokens(mc, max_len))
        cfg = self._assemble(source, mc_full, device, dtype, tp, num_pages, num_host_pages,
                             kv_bytes, max_len, sparse)
        self._check_full_mode(cfg)
        plan = plan_memory(cfg, budget)
        check_plan(plan, explicit=self.kv_cache_memory_bytes is not None)
        return cfg.replace(memory_plan=plan), source

    def _batched_tokens(self, max_len: int) -> int:
        """max_num_batched_tokens, raised to max_len when prompts may not be chunked."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_len:
            return max_len  # without chunking a whole prompt must fit in one step
        return self.max_num_batched_tokens

    def _inject_tokens(self, mc: ModelConfig, max_len: int) -> int | None:
        """max_inject_tokens of layer-segmented prefill (None without it)."""
        if not self.layer_segmented_prefill:
            return None
        return self.max_inject_tokens or self._batched_tokens(max_len) * mc.num_hidden_layers

    def _assemble(self, source, mc: ModelConfig, device: str, dtype: str, tp: int,
                  num_pages: int, num_host_pages: int, kv_bytes: int, max_len: int,
                  sparse: SparseConfig) -> EngineConfig:
        """The EngineConfig of these sizes (mc: the whole model; page counts per rank)."""
        batched = self._batched_tokens(max_len)
        inject = self._inject_tokens(mc, max_len)
        cfg = EngineConfig(
            model=mc,
            load=LoadConfig(model=source.path or source.name, load_format=source.kind,
                            tokenizer=self.tokenizer),
            cache=CacheConfig(page_size=self.page_size, num_pages=int(num_pages),
                              kv_cache_memory_bytes=kv_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              kv_offload=self.kv_offload, num_host_pages=int(num_host_pages),
                              h2d_method=self.h2d_method, d2h_method=self.d2h_method,
                              eviction=self.eviction),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=batched, max_model_len=max_len,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      max_inject_tokens=inject,
                                      working_set_control=bool(self.working_set_control
                                                               and self.kv_offload),
                                      working_set_window=self.working_set_window),
            sparse=sparse, device=device, dtype=dtype, seed=self.seed,
            enforce_eager=self.enforce_eager, async_scheduling=self.async_scheduling,
            cudagraph_mode=self.cudagraph_mode or "FULL",
            parallel=ParallelConfig(tensor_parallel_size=tp),
        )
        return cfg if self.cudagraph_mode else self._default_graph_mode(cfg)

    @staticmethod
    def _default_graph_mode(cfg: EngineConfig) -> EngineConfig:
        """cudagraph_mode left unset: FULL where it captures steps with prefill work (`cfg`
        has FULL), else FULL_DECODE_ONLY. Why FULL: a step with prefill work run eagerly
        spends 19-57 % of its time launching on the host (engine.md, twenty-eighth session),
        in graphs ~5 %; end to end: system.md, twenty-ninth session."""
        from sparseserve.engine.memory_plan import captures_mixed_graphs
        from sparseserve.engine.two_tier_graph_plan import captures_two_tier_graphs
        if captures_mixed_graphs(cfg) or captures_two_tier_graphs(cfg):
            return cfg
        return cfg.replace(cudagraph_mode="FULL_DECODE_ONLY")

    def _host_pages(self, page_bytes: int, mc: ModelConfig, tp: int = 1) -> int:
        """Host pages per rank: kv_offloading_size is the total over the tp ranks."""
        if not self.kv_offload:
            return 0
        size = self.kv_offloading_size
        if size is None:
            # what every running request at full length needs, at most half the free RAM
            import os
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            tokens = self.max_num_seqs * (self.max_model_len or mc.max_position_embeddings)
            need = -(-tokens // self.page_size) * mc.num_key_value_heads * tp * page_bytes
            size = min(need, free // 2) / GiB
            logger.info("kv_offloading_size not given: host tier of %.2f GiB (max_num_seqs x "
                        "max_model_len, at most half the free RAM)", size)
        if size <= 0:
            raise ValueError("kv_offloading_size must be > 0 (GiB of host memory for the host "
                             "tier, e.g. --kv-offloading-size 64).")
        pages = int(size * GiB) // tp // page_bytes
        return pages // HOST_CHUNK_PAGES * HOST_CHUNK_PAGES  # whole chunks (KVCacheManager)

    def _kv_bytes(self, device: str, tp: int,
                  draft: Callable[[int], EngineConfig]) -> tuple[int, int | None]:
        """(device KV cache bytes of one rank, the budget its memory plan must fit or None).

        kv_cache_memory_bytes is per rank and is the KV slots' size alone, as in vLLM; the
        budget is then what the GPU has free (weights, activations, summaries, metadata and
        graph pool come on top). On the CPU the ranks share the host's memory: the default
        of CPU_DEFAULT_KV_BYTES is their total (each rank's 1/tp of the KV heads then fits as
        many tokens as one process does); no budget. On GPUs by default each rank's budget is
        min(free, total x gpu_memory_utilization) of its GPU (the fullest of the tp), and the
        KV slots get what the memory plan of `draft(num_pages)` leaves (fit_num_pages):
        after its weight shard, activations, the summaries (with offload: of every host
        page), the metadata and the graph pool."""
        if self.kv_cache_memory_bytes is not None:
            if self.kv_cache_memory_bytes <= 0:
                raise ValueError("kv_cache_memory_bytes must be > 0.")
            free = gpu_memory(tp)[0] if device == "cuda" else None
            return int(self.kv_cache_memory_bytes), free
        if device == "cpu":
            return CPU_DEFAULT_KV_BYTES // tp, None
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1].")
        free, total = gpu_memory(tp)
        budget = min(free, int(total * self.gpu_memory_utilization))
        empty = draft(0)
        num_pages = fit_num_pages(empty, budget)
        if num_pages < 1:
            rest = plan_memory(empty, budget)
            raise ValueError(f"No GPU memory left for the KV cache after weights, activations, "
                             f"summaries, metadata and graph pool ({rest.describe()}); raise "
                             "gpu_memory_utilization, use a smaller model or a larger "
                             "tensor_parallel_size" + (", or lower kv_offloading_size (the "
                             "summaries of every host page stay in HBM)" if self.kv_offload
                             else "") + ".")
        return num_pages * kv_page_bytes(empty), budget


def _resolve_dtype(dtype: str, device: str, mc: ModelConfig) -> str:
    if dtype == "auto":
        if device == "cpu":
            return "float32"  # CPU matmuls in bf16 are slow and less exact
        return "float16" if mc.torch_dtype == "float16" else "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} not supported; use auto, float32, bfloat16 or float16.")
    return dtype
