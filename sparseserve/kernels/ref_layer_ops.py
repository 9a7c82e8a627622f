"""Pure-torch references of ``fused_layer_ops``: the model's own torch code paths
(``model.layers``: RMSNorm, rotate, the gated MLP's activation; the residual add of
``cpu_linear.linear``), with the same contracts as the kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N], weight [N] -> [T, N]: exactly ``model.layers.RMSNorm.forward``."""
    from sparseserve.model.layers import rms_norm as _torch_rms_norm
    return _torch_rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(residual + x), residual + x); residual None: (rms_norm(x), x). The add
    is the unfused model's ``residual + out`` (``cpu_linear.linear(..., residual=)`` off the
    packed CPU path)."""
    new = x if residual is None else residual + x
    return rms_norm(new, weight, eps), new


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> rotated copy: ``model.layers.rotate(x, (cos, sin))``."""
    from sparseserve.model.layers import rotate
    return rotate(x, (cos, sin))


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
              num_kv_heads: int) -> torch.Tensor:
    """qkv [T, Hq + 2 Hkv, D] -> copy with q and k rotated as the unfused attention does
    (one ``rotate`` of the first Hq + Hkv heads), v unchanged."""
    n = num_q_heads + num_kv_heads
    return torch.cat([rotary(qkv[:, :n], cos, sin), qkv[:, n:]], dim=1)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """gate_up [T, 2 I] -> [T, I]: ``F.silu(gate) * up`` as ``GatedMLP.forward`` computes it
    off the packed CPU path."""
    gate, up = gate_up.split(intermediate, dim=-1)
    return F.silu(gate) * up
