"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP."""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from sparseserve.kernels import rms_norm_cpu_fused as cpu_norm
from sparseserve.model.cpu_linear import linear, silu_mul


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                    res_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused path (one Triton launch): x, residual [T, hidden] -> (forward(residual
        + x), residual + x); residual None: (forward(x), x). ``res_out``: where residual + x
        goes (it may be ``residual``: in place)."""
        from sparseserve.kernels.fused_layer_ops import fused_add_rms_norm
        return fused_add_rms_norm(x, residual, self.weight, self.eps, res_out=res_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., N] with weight [N] (the torch path; kernels/fused_layer_ops fuses it)."""
    # Normalise in fp32 like transformers, then cast back before the weight multiply.
    # One fused op (x * rsqrt(mean(x^2) + eps) * weight) where no cast is needed.
    shape = (x.shape[-1],)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # on CPU one C++ pass instead of F.rms_norm's composite (pow, mean, add, rsqrt, mul)
        if cpu_norm.usable(x, weight):
            return cpu_norm.add_rms_norm(x, None, weight, eps)[0]
        return F.rms_norm(x, shape, weight, eps)
    return weight * F.rms_norm(x.float(), shape, eps=eps).to(x.dtype)


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
        self._full: torch.Tensor | None = None

    def table(self, device: torch.device) -> torch.Tensor:
        # [max_positions, head_dim]: cos in the first half, sin in the second
        if self._table is None or self._table.device != device:
            t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(device))
            self._table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        return self._table

    def full_table(self, device: torch.device) -> torch.Tensor:
        # [max_positions, 2, head_dim]: (cos, cos) and (-sin, sin), the rotate-half factors
        if self._full is None or self._full.device != device:
            cos, sin = self.table(device).chunk(2, dim=-1)
            self._full = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)
        return self._full

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation factors of `positions` [T]: cos [T, 1, D], signed sin [T, 1, D].
        Once per step (every layer rotates with the same ones)."""
        cs = self.full_table(positions.device)[positions]  # [T, 2, D]
        return cs[:, 0:1], cs[:, 1:2]

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, Hq, D]; k [T, Hkv, D]
        cs = self.cos_sin(positions)
        return rotate(q, cs), rotate(k, cs)


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] with `RotaryEmbedding.cos_sin`'s factors, in fp32:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as x * (cos, cos) + (x2, x1) * (-sin, sin)
    (the same roundings: negating is exact)."""
    cos, sin = cos_sin
    xf = x if x.dtype == torch.float32 else x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = xf * cos + torch.cat([x2, x1], dim=-1) * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


def fuse_linears(owner: nn.Module, name: str, linears: list[nn.Linear]) -> None:
    """Make the weights (and biases) of `linears` views of one [sum(out), in] buffer
    `owner.<name>_weight` (`<name>_bias`), so one GEMM computes all their outputs while the
    parameters keep their names, shapes and loaders (they copy into the views). Their current
    values are kept. A non-persistent buffer: state dicts are unchanged. `fused_ok` tells
    whether the views still alias the buffer (a `.to()` / `_apply` replaces each tensor)."""
    w = torch.cat([lin.weight.detach() for lin in linears])
    owner.register_buffer(name + "_weight", w, persistent=False)
    has_bias = linears[0].bias is not None
    b = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    owner.register_buffer(name + "_bias", b, persistent=False)
    start = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = nn.Parameter(w[start:start + n], requires_grad=lin.weight.requires_grad)
        if has_bias:
            lin.bias = nn.Parameter(b[start:start + n], requires_grad=lin.bias.requires_grad)
        start += n


def fused_ok(weight: torch.Tensor, linears: list[nn.Linear]) -> bool:
    """Whether `linears`' weights are still the consecutive row blocks of `weight`."""
    ptr, row = weight.data_ptr(), weight.stride(0) * weight.element_size()
    for lin in linears:
        if lin.weight.data_ptr() != ptr:
            return False
        ptr += lin.out_features * row
    return True


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
        self.intermediate = intermediate_size
        with torch.no_grad():
            fuse_linears(self, "gate_up", [self.gate_proj, self.up_proj])  # one GEMM for both

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                fused: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] (+ residual, added after the all-reduce with tp).
        `fused`: the activation is one Triton launch (kernels/fused_layer_ops.py). `out`
        [T, hidden] (no residual, no tp): the down projection's GEMM writes there (``torch.mm``
        with ``out=``: F.linear's GEMM on CUDA, not the CPU's packed oneDNN one; inference
        mode only, as the engine runs)."""
        # CPU, packed weights: the activation rides on the GEMMs (None elsewhere)
        act = None if fused else silu_mul(x, self.gate_proj.weight, self.up_proj.weight)
        if act is None:
            if fused_ok(self.gate_up_weight, [self.gate_proj, self.up_proj]):
                gate, up = linear(x, self.gate_up_weight).split(self.intermediate, dim=-1)
            else:
                gate, up = linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)
            if fused:
                from sparseserve.kernels.fused_layer_ops import silu_mul_split
                act = silu_mul_split(gate, up)
            else:
                act = F.silu(gate) * up
        if out is not None:
            if residual is not None or self.tp is not None:
                raise ValueError("GatedMLP: out= takes the down projection alone (no residual, "
                                 "no tensor parallelism)")
            return torch.mm(act, self.down_proj.weight.t(), out=out)
        if self.tp is None:
            return linear(act, self.down_proj.weight, residual=residual)
        out = self.tp.all_reduce(linear(act, self.down_proj.weight))
        return out if residual is None else residual + out
