"""The forward context: one per group of layers in a step, entered explicitly.

It tells attention where each new token's K/V goes (per-KV-head pages) and how to attend:
decode tokens (first `num_decode` rows) through the paged-decode kernel, prefill chunks
through SDPA over the request's own KV. Everything decode needs is derived on the device
from (rows, positions), so a decode-only step can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparseserve.kernels import paged_decode_attention


@dataclass
class PrefillSeq:
    q_start: int  # first row of this chunk in the context's token batch
    q_end: int
    start: int  # tokens already in the KV cache before the chunk (its first position)
    row: int  # batch row of the request (index into the page table)


class KVCacheTensors:
    """Device K/V storage: per layer [num_pages, page_size, head_dim] each (owned by the worker)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_pages, page_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_size = page_size


class ForwardContext:
    """Attention over paged KV for one token batch.

    page_table: [max_rows, Hkv, max_blocks] int32 device table of every running request.
    rows:       [T] int64  batch row of each token's request
    positions:  [T] int64  absolute position of each token
    Rows [0, num_decode) are decode tokens (one per request, attending to positions <= own).
    """

    def __init__(self, kv: KVCacheTensors, page_table: torch.Tensor, rows: torch.Tensor,
                 positions: torch.Tensor, num_decode: int, prefills: list[PrefillSeq],
                 scale: float, decode_width: int | None = None) -> None:
        self.kv = kv
        self.page_table = page_table
        self.num_decode = num_decode
        self.prefills = prefills
        self.scale = scale
        ps = kv.page_size
        hkv = page_table.shape[1]
        heads = torch.arange(hkv, device=rows.device)
        # where each token's K/V lands: page [T, Hkv] and offset [T, 1] within it
        self.store_pages = page_table[rows[:, None], heads[None, :],
                                      torch.div(positions, ps, rounding_mode="floor")[:, None]].long()
        self.store_offsets = (positions % ps)[:, None]
        if num_decode:
            drows = rows[:num_decode]
            seq_lens = positions[:num_decode] + 1
            width = decode_width or page_table.shape[2]
            self.dec_page_table = page_table[drows, :, :width]  # [Bd, Hkv, W]
            n_pages = torch.div(seq_lens + ps - 1, ps, rounding_mode="floor")
            self.dec_num_pages = n_pages[:, None].expand(-1, hkv).to(torch.int32).contiguous()
            self.dec_last_len = (seq_lens - (n_pages - 1) * ps).to(torch.int32)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
        # q [T, Hq, D]; k, v [T, Hkv, D]
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        k_cache[self.store_pages, self.store_offsets] = k
        v_cache[self.store_pages, self.store_offsets] = v
        out = torch.empty_like(q)
        nd = self.num_decode
        if nd:
            # the Triton kernel on GPU, its torch reference on CPU
            out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, self.dec_page_table,
                                              self.dec_num_pages, self.dec_last_len, self.scale)
        for p in self.prefills:
            out[p.q_start:p.q_end] = self._prefill(p, q, k, v, k_cache, v_cache)
        return out

    def _prefill(self, p: PrefillSeq, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        n = p.q_end - p.q_start
        qs = q[p.q_start:p.q_end].transpose(0, 1)  # [Hq, n, D]
        if p.start == 0:
            ks = k[p.q_start:p.q_end].transpose(0, 1)  # [Hkv, n, D]
            vs = v[p.q_start:p.q_end].transpose(0, 1)
            mask, causal = None, True
        else:
            total = p.start + n
            ps = self.kv.page_size
            pages = self.page_table[p.row, :, :(total + ps - 1) // ps].long()  # [Hkv, nb]
            hkv, nb = pages.shape
            ks = k_cache[pages].reshape(hkv, nb * ps, -1)[:, :total]
            vs = v_cache[pages].reshape(hkv, nb * ps, -1)[:, :total]
            qpos = torch.arange(p.start, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]  # [n, total]
            causal = False
        out = F.scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
                                             attn_mask=mask, is_causal=causal, scale=self.scale,
                                             enable_gqa=qs.shape[0] != ks.shape[0])
        return out[0].transpose(0, 1)  # [n, Hq, D]
