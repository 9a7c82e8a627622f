"""Sizes for benchmarks/offload.py: the byte sizes of the model's KV in the engine's units
(pages, host pages in whole chunks, pinned bytes, weights) and what the host has (RAM,
CUDA's pinned-memory counters)."""
from __future__ import annotations

from sparseserve.config import HOST_CHUNK_PAGES

GiB = 1 << 30


class Shape:
    """Byte sizes of the model's KV at a page size (the engine's units)."""

    def __init__(self, cfg: dict, dtype_bytes: int, page_size: int) -> None:
        self.layers = int(cfg["num_hidden_layers"])
        self.kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        self.head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        self.dtype_bytes = dtype_bytes
        self.page_size = page_size
        # one page id covers every layer: what kv_cache_memory_bytes / kv_offloading_size count
        self.page_bytes = 2 * self.layers * page_size * self.head_dim * dtype_bytes
        # K+V of one page in one layer: what a load moves
        self.layer_page_bytes = 2 * page_size * self.head_dim * dtype_bytes
        self.kv_bytes_per_token = 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes
        h, i = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        d, hq, v = self.head_dim, int(cfg["num_attention_heads"]), int(cfg["vocab_size"])
        layer = h * d * (2 * hq + 2 * self.kv_heads) + 3 * h * i + 2 * h
        head = 0 if cfg.get("tie_word_embeddings") else v * h
        self.weight_bytes = (self.layers * layer + v * h + head + h) * dtype_bytes

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def ids(self, batch: int, tokens: int) -> int:
        """Page ids B requests of `tokens` tokens use (one per KV head and block)."""
        return batch * self.kv_heads * self.pages(tokens)

    def host_ids(self, batch: int, tokens: int) -> int:
        """Host page ids they take: each (request, KV head) in whole chunks of
        HOST_CHUNK_PAGES pages (the two-level page table)."""
        C = HOST_CHUNK_PAGES
        return batch * self.kv_heads * (-(-self.pages(tokens) // C) * C)

    def pinned_bytes(self, num_ids: int) -> int:
        """Host bytes the engine pins for `num_ids` host pages: per layer a K and a V tensor
        of num_ids + 1 (scratch) pages (registered at their exact size: TwoTierCache)."""
        return 2 * self.layers * (num_ids + 1) * self.page_size * self.head_dim * self.dtype_bytes

    def describe(self) -> dict:
        """The sizes as result["shape"] records them."""
        return {"layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "page_bytes_all_layers": self.page_bytes,
                "layer_page_bytes": self.layer_page_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "weight_gib": self.weight_bytes / GiB}


def meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def host_pinned_stats() -> dict | None:
    import torch

    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        s = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001
        return None
    keep = ("allocated_bytes.current", "allocated_bytes.peak", "num_host_alloc",
            "num_host_free", "host_alloc_time.total", "host_free_time.total")
    return {k: s.get(k) for k in keep if k in s}
