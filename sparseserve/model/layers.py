"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP."""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like transformers, then cast back before the weight multiply.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float,
                             scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for rotate-half RoPE, with Llama 3 / linear scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    if kind == "default":
        return inv_freq.float()
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3.")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Mapping[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, theta, scaling),
                             persistent=False)
        self._table: torch.Tensor | None = None

    def table(self, device: torch.device) -> torch.Tensor:
        # [max_positions, head_dim]: cos in the first half, sin in the second
        if self._table is None or self._table.device != device:
            t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(device))
            self._table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        return self._table

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, Hq, D]; k [T, Hkv, D]
        cos_sin = self.table(q.device)[positions]  # [T, D]
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class GatedMLP(nn.Module):
    """SiLU-gated MLP. With `tp` (a model.parallel.TensorParallel) gate/up are column-parallel
    and down row-parallel over intermediate_size / tp.size columns, then one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp=None) -> None:
        super().__init__()
        self.tp = tp
        if tp is not None:
            intermediate_size //= tp.size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.tp is None else self.tp.all_reduce(out)
