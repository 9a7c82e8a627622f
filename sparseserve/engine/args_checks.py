"""EngineArgs' checks of its knobs against each other, the model and the visible devices (a
mixin of `EngineArgs`, engine/args.py): the CUDA graph mode, tensor parallelism, the
two-tier cache and the sparse config."""
from __future__ import annotations

import logging

from sparseserve.config import CUDAGRAPH_MODES, CacheConfig, ModelConfig, SparseConfig

logger = logging.getLogger("sparseserve")


class EngineArgsChecks:
    """The checks of `EngineArgs`' fields: raise ValueError (or warn of a knob with no
    effect) before any weight is loaded."""

    def _check_graph_mode(self, device: str, tp: int) -> None:
        if self.cudagraph_mode is None:
            return  # the default: resolved per configuration (EngineArgs._default_graph_mode)
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode {self.cudagraph_mode!r} is not one of "
                             f"{', '.join(CUDAGRAPH_MODES)}.")
        if self.cudagraph_mode != "FULL_DECODE_ONLY" and (device != "cuda" or self.enforce_eager
                                                          or tp > 1):
            why = ("enforce_eager is set" if self.enforce_eager else
                   "tensor parallelism runs its layers eagerly" if tp > 1 else
                   f"there are no CUDA graphs on {device}")
            logger.warning("cudagraph_mode %s has no effect: %s", self.cudagraph_mode, why)

    def _check_full_mode(self, cfg) -> None:
        """cudagraph_mode FULL with sparse attention or the two-tier cache (cfg: the final
        EngineConfig): its whole-step graphs are for dense attention over device pages only, so
        say what it captures here beyond FULL_DECODE_ONLY — the two-tier prefill graphs, under
        the conditions that decide their capture (two_tier_graph_plan), or nothing."""
        from sparseserve.engine.two_tier_graph_plan import why_no_two_tier_graphs
        from sparseserve.worker.two_tier_graphs import MAX_TOKENS
        if (self.cudagraph_mode != "FULL" or cfg.device != "cuda" or cfg.enforce_eager
                or cfg.parallel.tensor_parallel_size > 1
                or not (cfg.sparse.enabled or cfg.cache.kv_offload)):
            return  # whole-step graphs, or no graph at all (_check_graph_mode said so)
        dense_only = ("cudagraph_mode FULL captures whole steps with prefill work for dense "
                      "attention over device pages only")
        why = why_no_two_tier_graphs(cfg)
        if why is None:
            n = min(cfg.scheduler.max_model_len, MAX_TOKENS)
            logger.warning("%s; with sparse attention and the two-tier cache it captures the "
                           "layer segments of whole prompts (slot-free, up to %d tokens: "
                           "two_tier_graphs.MAX_TOKENS = %d), one graph per layer and token "
                           "bucket (worker/two_tier_graphs.py); prompts over %d tokens, chunks "
                           "that continue a prefix and other prefill work run eagerly as with "
                           "FULL_DECODE_ONLY", dense_only, n, MAX_TOKENS, MAX_TOKENS)
            return
        logger.warning("%s, and the two-tier prefill graphs (layer segments of whole prompts "
                       "up to %d tokens) need the two-tier cache with a sparse algorithm, "
                       "d2h_method gpu-direct and layer-segmented prefill (the sparseserve "
                       "preset). Here %s: FULL does nothing beyond FULL_DECODE_ONLY",
                       dense_only, MAX_TOKENS, why)

    def _check_parallel(self, mc: ModelConfig, device: str) -> int:
        """The tensor-parallel size, checked against the model and the visible GPUs."""
        from sparseserve.model.parallel import check_tp_divisible

        tp = self.tensor_parallel_size
        check_tp_divisible(mc, tp)
        if self.async_scheduling and tp > 1:
            raise ValueError("async_scheduling runs on one GPU only for now; drop "
                             "--async-scheduling or use tensor_parallel_size=1.")
        if self.async_scheduling and device != "cuda":
            logger.warning("async_scheduling overlaps nothing on %s (its ops run as they are "
                           "issued): steps run one ahead, with the same results", device)
        if device == "cuda" and tp > 1:
            import torch
            n = torch.cuda.device_count()
            if tp > n:
                raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs but {n} are "
                                 "visible; lower it or expose more GPUs (CUDA_VISIBLE_DEVICES).")
        return tp

    def _check_offload(self, sparse: SparseConfig, mc: ModelConfig, num_slots: int,
                       max_len: int, inject: int | None) -> None:
        from sparseserve.kvcache.eviction import EVICTION_POLICIES
        from sparseserve.transfer import D2H_METHODS, H2D_METHODS
        if not sparse.enabled or sparse.algorithm == "oracle":
            raise ValueError("kv_offload needs a sparse_algorithm that scores pages from "
                             "summaries (quest, arkvale, infllm, streaming): dense decode would "
                             "load every page every step.")
        if sparse.dense_layers:
            raise ValueError("kv_offload does not support dense_layers yet; use dense_layers=0.")
        if self.h2d_method not in H2D_METHODS or self.d2h_method not in D2H_METHODS:
            raise ValueError(f"h2d_method must be one of {H2D_METHODS}, d2h_method one of "
                             f"{D2H_METHODS}.")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}.")
        # how many requests decode at once is bounded per step by the scheduler (their
        # working sets must fit the slots); statically, one longest prompt must fit, since a
        # prefill keeps every page of its prompt in slots (one layer's worth per pool) —
        # unless every prompt is prefilled whole and slot-free (layer-segmented, saves ordered
        # on the device, max_model_len <= max_inject_tokens): then one decode selection must
        slot_free = (inject is not None and inject >= max_len
                     and CacheConfig(d2h_method=self.d2h_method).saves_ordered_on_device)
        tokens = min(max_len, sparse.token_budget) if slot_free else max_len
        need = -(-tokens // self.page_size) * mc.num_key_value_heads
        if num_slots < need:
            what = ("one decode step's selection" if slot_free else
                    f"a prompt of max_model_len={max_len} tokens while it is prefilled")
            raise ValueError(f"The device cache has {num_slots} slots per layer but {what} "
                             f"needs {need}; raise kv_cache_memory_bytes or lower "
                             "max_model_len (or token_budget).")

    def _sparse_config(self, mc: ModelConfig) -> SparseConfig:
        from sparseserve.sparse import get_algorithm_class
        get_algorithm_class(self.sparse_algorithm)  # raises with the list of algorithms
        if self.token_budget % self.page_size or self.token_budget < 2 * self.page_size:
            raise ValueError(f"token_budget ({self.token_budget}) must be a multiple of "
                             f"page_size ({self.page_size}) and at least two pages.")
        budget_pages = self.token_budget // self.page_size
        if self.sink_pages < 0 or self.local_pages < 1:
            raise ValueError("sink_pages must be >= 0 and local_pages >= 1 (the partial last "
                             "page is always attended).")
        if self.sink_pages + self.local_pages > budget_pages:
            raise ValueError(f"sink_pages + local_pages ({self.sink_pages + self.local_pages}) "
                             f"exceed the token budget of {budget_pages} pages; raise "
                             "token_budget or keep fewer pages.")
        if not 0 <= self.dense_layers <= mc.num_hidden_layers:
            raise ValueError(f"dense_layers must be in [0, {mc.num_hidden_layers}].")
        return SparseConfig(algorithm=self.sparse_algorithm, token_budget=self.token_budget,
                            sink_pages=self.sink_pages, local_pages=self.local_pages,
                            dense_layers=self.dense_layers)
