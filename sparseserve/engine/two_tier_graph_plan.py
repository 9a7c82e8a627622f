"""Whether the runner captures the two-tier prefill graphs (worker/two_tier_graphs.py), their
token buckets and what they hold in device memory (memory_plan.graph_pool_bytes adds it)."""
from __future__ import annotations

from sparseserve.config import EngineConfig


def captures_two_tier_graphs(cfg: EngineConfig) -> bool:
    """cudagraph_mode FULL on one CUDA device without enforce_eager, with the two-tier cache's
    layer-segmented prefill (slot-free prompts), GPU-direct saves and a sparse algorithm (the
    sparseserve preset); the other two-tier configurations keep their eager prefill."""
    return why_no_two_tier_graphs(cfg) is None


def why_no_two_tier_graphs(cfg: EngineConfig) -> str | None:
    """Why `cfg` captures no two-tier prefill graphs (the first condition of
    captures_two_tier_graphs it misses, in words), or None when it captures them."""
    c = cfg.cache
    if cfg.device != "cuda":
        return f"there are no CUDA graphs on {cfg.device}"
    if cfg.enforce_eager:
        return "enforce_eager is set"
    if cfg.cudagraph_mode != "FULL":
        return f"cudagraph_mode is {cfg.cudagraph_mode}, not FULL"
    if cfg.parallel.tensor_parallel_size != 1:
        return "tensor parallelism runs its layers eagerly"
    if not c.kv_offload:
        return "the two-tier cache (kv_offload) is off"
    if not cfg.sparse.enabled:
        return "no sparse algorithm"
    if c.d2h_method != "gpu-direct":
        return (f"d2h_method is {c.d2h_method}, not gpu-direct (the graphs save with "
                "GPU-direct writes)")
    if cfg.scheduler.max_inject_tokens is None:
        return ("layer-segmented prefill is off (max_inject_tokens None): no prompt is "
                "prefilled slot-free")
    return None


def two_tier_graph_buckets(cfg: EngineConfig) -> list[int]:
    """The cuDNN prefill plans' lengths (prefill_attention.bucket_lengths) up to the smaller of
    the model length and two_tier_graphs.MAX_TOKENS."""
    from sparseserve.worker.prefill_attention import bucket_lengths
    from sparseserve.worker.two_tier_graphs import MAX_TOKENS
    return bucket_lengths(min(cfg.scheduler.max_model_len, MAX_TOKENS))


def two_tier_graph_bytes(cfg: EngineConfig) -> int:
    """Their static buffers (stream and residual [n + 1, hidden], fp32 RoPE [n, 2, D], the
    plan: (Hkv + 3) int64 per token, 16 bytes per (page, KV head) and 8 per page, the padding
    index (two int64 per row of the largest bucket step, at most n), the slot table
    [L, Hkv, pages + 1] int32) and their pool, which holds one layer's intermediates at the
    largest bucket n: qkv, attention's padded q / k / v and output (twice: the reshape), the
    gathered pages' K, the two norms' outputs and the O projection [n, hidden] x 3 (the
    residual and the MLP's output are written into the static stream), the MLP's gate/up
    [n, 2 I] and its product [n, I]; 0 when none are captured."""
    if not captures_two_tier_graphs(cfg):
        return 0
    from sparseserve.engine.memory_plan import DTYPE_BYTES
    mc = cfg.model
    n = two_tier_graph_buckets(cfg)[-1]
    e = DTYPE_BYTES[cfg.dtype]
    hkv, hq, d = mc.num_key_value_heads, mc.num_attention_heads, mc.head_dim
    pages = -(-n // cfg.cache.page_size) + 1
    static = ((n + 1) * 2 * mc.hidden_size * e + n * (2 * d * 4 + (hkv + 3) * 8 + 16)
              + pages * (hkv * 16 + 8)
              + mc.num_hidden_layers * hkv * pages * 4)
    pool = n * e * (2 * (hq + 2 * hkv) * d + 2 * hq * d + hkv * d + 3 * mc.hidden_size
                    + 3 * mc.intermediate_size)
    return static + pool
