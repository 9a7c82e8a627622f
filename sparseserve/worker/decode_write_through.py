"""The decode rows' DRAM write-through, once per step for every layer.

Every page lives in DRAM, so each decode token's K/V must reach its host page too. Writing it
from the per-layer slot store (pinned memory by UVA) made each layer's launch wait for its
PCIe writes (~12 us instead of ~3 on the H200); instead the slot store copies the rows into a
device stage [2, L, rows + 1, Hkv, D] (`stage`), and after the step's layers one GPU-direct
launch writes every layer's rows to DRAM (`flush`), on the compute stream: before any later
step can evict and load those pages back. Fixed shapes, no host sync: part of the decode
step's CUDA graph.
"""
from __future__ import annotations

import torch


class DecodeWriteThrough:
    def __init__(self, host: torch.Tensor, num_rows: int) -> None:
        """host: the host tier [2, L, P + 1, page_size, D] (pinned on a GPU); num_rows: the
        batch rows (the stage holds one more: CUDA-graph padding lanes)."""
        self.host = host
        self.num_rows = num_rows
        self.stage_buf: torch.Tensor | None = None

    def allocate(self, hkv: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        L = self.host.shape[1]
        self.stage_buf = torch.empty((2, L, self.num_rows + 1, hkv, head_dim), dtype=dtype,
                                     device=device)

    def stage(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the slot store copies the new K / V of `layer`, k [n, Hkv, D] (and as much
        V): ([n, Hkv, D], [n, Hkv, D]) contiguous. Allocated at first use when not before."""
        if self.stage_buf is None:
            self.allocate(k.shape[1], k.shape[2], k.dtype, k.device)
        n = k.shape[0]
        return self.stage_buf[0, layer, :n], self.stage_buf[1, layer, :n]

    def flush(self, l0: int, l1: int, pages: torch.Tensor, offsets: torch.Tensor) -> None:
        """host[l][pages[b, h], offsets[b]] = stage[l][b, h] for the layers [l0, l1) in one
        launch. pages [B, Hkv] host ids (< 0: not saved), offsets [B] int."""
        n, hkv = pages.shape
        L = l1 - l0
        stage_k = self.stage_buf[0, l0:l1, :n].reshape(L * n, hkv, -1)
        stage_v = self.stage_buf[1, l0:l1, :n].reshape(L * n, hkv, -1)
        per_layer = self.host.shape[2]                         # host pages + 1 per layer
        base = torch.arange(l0, l1, device=pages.device).view(L, 1, 1) * per_layer
        ids = torch.where(pages >= 0, pages.long() + base, -1).view(L * n, hkv)
        offs = offsets.long().repeat(L).view(-1, 1).expand(L * n, hkv)
        host_k = self.host[0].view(-1, *self.host.shape[3:])   # [L * (P + 1), ps, D]
        host_v = self.host[1].view(-1, *self.host.shape[3:])
        from sparseserve.transfer.gpu_direct import save_rows
        save_rows(host_k, host_v, stage_k, stage_v, ids, offs)
