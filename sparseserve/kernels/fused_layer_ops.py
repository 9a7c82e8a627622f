"""Fused elementwise ops of a decoder layer (the model's GPU path): one launch each where the
torch code paths (``ref_layer_ops``, the specifications) launch 2-6 small kernels.

* ``fused_add_rms_norm``: residual add + RMSNorm (add, float cast, rms_norm (2 kernels on
  CUDA), cast back, weight multiply: 6 launches -> 1).
* ``rotary_`` / ``rotary_qk_``: rotate-half RoPE in place on q and k of the fused qkv
  output (float cast, cat, 2 multiplies, add, cast back: 6 -> 1).
* ``silu_mul``: silu(gate) * up of the fused gate/up GEMM output (2 -> 1).

Measured on an H200 (Llama-3-8B widths, bf16, one decode token, 32 layers without attention,
torch 2.11): 24 -> 10 CUDA kernels per layer (6 are GEMM kernels: 4 GEMMs, 2 split-K
reductions), CUDA-graph replay 4.92 -> 4.13 ms; the residual stream after 32 layers bitwise
equal to the torch path's.

Each rounds exactly where its reference does: fp32 math, then a rounding to the storage
dtype after every op that torch runs in that dtype. FP contraction is off
(``enable_fp_fusion=False``: a mul + add contracted into an FMA would round once instead of
twice, changing the last fp32 bit); the division is IEEE (``div_rn``) and exp is libdevice's
``expf`` (CUDA torch's) when compiled. Rounding to bf16 is done by hand with integer ops
(``_round_to``): Triton's interpreter truncates fp32 -> bf16 instead of rounding to nearest even.

Kernels are leaves (tensors and ints in), run with fixed grids and no host sync (CUDA-graph
capturable). On CPU tensors they need ``TRITON_INTERPRET=1`` set before triton is imported.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_", "rotary_qk_", "silu_mul",
           "silu_mul_split"]

_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TILE = 2048  # elements a program holds (rows of a short hidden / head dim are batched to it)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kind(t: torch.Tensor) -> int:
    if t.dtype not in _KIND:
        raise TypeError(f"fused_layer_ops: unsupported dtype {t.dtype} (fp32, fp16, bf16)")
    return _KIND[t.dtype]


@triton.jit
def _round_to(x, KIND: tl.constexpr):
    """fp32 x -> fp32 holding x rounded to nearest even in the storage dtype (KIND: 0 fp32,
    1 fp16, 2 bf16). bf16 by integer ops: same bits compiled and interpreted (NaN payloads
    in the low half may turn into inf: not a case the model meets)."""
    y = x
    if KIND == 2:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        y = b.to(tl.float32, bitcast=True)
    elif KIND == 1:
        y = x.to(tl.float16).to(tl.float32)
    return y


# ---- residual add + RMSNorm ---------------------------------------------------------------

# sizes that change from step to step are not specialised on (== 1, % 16): a new size
# class would compile a variant mid-serving, which the start-up warm-up cannot foresee
@triton.jit(do_not_specialize=["T"])
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, T, N, sx, sr, so, sres, eps,
                         HAS_RES: tl.constexpr, KIND: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    m = (rows < T)[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * sx + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + rows * sr + cols[None, :], mask=m, other=0.0).to(tl.float32)
        x = _round_to(x + r, KIND)  # torch's dtype add: fp32 sum, one rounding
        tl.store(res_ptr + rows * sres + cols[None, :], x.to(res_ptr.dtype.element_ty), mask=m)
    # F.rms_norm's decomposition: rsqrt(mean(x^2) + eps), in fp32
    var = tl.sum(x * x, axis=1) / N
    rstd = tl.math.rsqrt(var + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = _round_to(x * rstd, KIND)  # RMSNorm.forward: .to(x.dtype) before the weight
    y = _round_to(y * w, KIND)     # then the dtype multiply (exact fp32 product, one rounding)
    tl.store(out_ptr + rows * so + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, res_out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N], residual [T, N] or None, weight [N] (x's dtype) -> (normed [T, N],
    new_residual [T, N]): new_residual = residual + x (x itself when residual is None, no copy),
    normed = ``RMSNorm.forward(new_residual)``. Rows may be strided (last dim contiguous);
    outputs are new contiguous tensors, but for ``res_out`` [T, N] (with a residual): the new
    residual is written there, and it may be ``residual`` itself (each program reads its whole
    rows before it writes them: in place is safe)."""
    T, N = x.shape
    assert weight.shape == (N,) and weight.dtype == x.dtype and weight.is_contiguous()
    assert x.stride(-1) == 1
    kind = _kind(x)
    if res_out is not None and residual is None:
        raise ValueError("fused_add_rms_norm: res_out needs a residual (without one the "
                         "stream is x itself, returned as it is)")
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if residual is None:
        res, r, sr = x, x, 0
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        res, r, sr = torch.empty_like(out), residual, residual.stride(0)
        if res_out is not None:
            assert res_out.shape == x.shape and res_out.dtype == x.dtype \
                and res_out.stride(-1) == 1
            res = res_out
    if T == 0:
        return out, res
    BLOCK = triton.next_power_of_2(N)
    ROWS = max(1, _TILE // BLOCK)  # whole rows: several per program when they are short
    _add_rms_norm_kernel[(triton.cdiv(T, ROWS),)](
        x, r, weight, out, res, T, N, x.stride(0), sr, out.stride(0), res.stride(0), float(eps),
        HAS_RES=residual is not None, KIND=kind, ROWS=ROWS, BLOCK=BLOCK,
        num_warps=max(1, min(16, ROWS * BLOCK // 512)), enable_fp_fusion=False)
    return out, res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm.forward(x)`` in one launch: x [T, N], weight [N] -> [T, N]."""
    return fused_add_rms_norm(x, None, weight, eps)[0]


# ---- rotary embedding ---------------------------------------------------------------------

# sizes that change from step to step are not specialised on (== 1, % 16): a new size
# class would compile a variant mid-serving, which the start-up warm-up cannot foresee
@triton.jit(do_not_specialize=["T"])
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, T, H, sxt, sxh, sct, sst, HALF,
                   KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # a tile of ROWS (token, head) pairs x BLOCK_D pairs of rotated channels
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t = (i // H)[:, None]
    h = (i % H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = (i < T * H)[:, None] & (d < HALF)
    p = x_ptr + t * sxt + h * sxh + d
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * sct + d, mask=m, other=0.0)
    c2 = tl.load(cos_ptr + t * sct + HALF + d, mask=m, other=0.0)
    s1 = tl.load(sin_ptr + t * sst + d, mask=m, other=0.0)  # -sin
    s2 = tl.load(sin_ptr + t * sst + HALF + d, mask=m, other=0.0)  # +sin
    # rotate: x * (cos, cos) + (x2, x1) * (-sin, sin): two rounded products, a rounded sum
    o1 = _round_to(x1 * c1 + x2 * s1, KIND)
    o2 = _round_to(x2 * c2 + x1 * s2, KIND)
    tl.store(p, o1.to(x_ptr.dtype.element_ty), mask=m)
    tl.store(p + HALF, o2.to(x_ptr.dtype.element_ty), mask=m)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place: x [T, H, D] (last dim contiguous, any token/head strides) <- ``rotate(x,
    (cos, sin))`` with ``RotaryEmbedding.cos_sin``'s fp32 factors cos [T, 1, D] = (cos, cos),
    sin [T, 1, D] = (-sin, sin) (last dim contiguous). Returns x."""
    T, H, D = x.shape
    assert D % 2 == 0 and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32
    assert cos.shape[0] == T and sin.shape[0] == T and cos.shape[-1] == D == sin.shape[-1]
    if T == 0 or H == 0:
        return x
    half = D // 2
    BLOCK_D = triton.next_power_of_2(half)
    ROWS = max(1, _TILE // BLOCK_D)
    _rotary_kernel[(triton.cdiv(T * H, ROWS),)](
        x, cos, sin, T, H, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), half,
        KIND=_kind(x), ROWS=ROWS, BLOCK_D=BLOCK_D, num_warps=4, enable_fp_fusion=False)
    return x


def rotary_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
               num_kv_heads: int) -> torch.Tensor:
    """In place: rotate the q and k heads (the first Hq + Hkv) of the fused projection output
    qkv [T, Hq + 2 Hkv, D]; v is untouched. One launch. Returns qkv."""
    assert qkv.shape[1] == num_q_heads + 2 * num_kv_heads
    rotary_(qkv[:, :num_q_heads + num_kv_heads], cos, sin)
    return qkv


# ---- SiLU-gated activation ----------------------------------------------------------------

# sizes that change from step to step are not specialised on (== 1, % 16): a new size
# class would compile a variant mid-serving, which the start-up warm-up cannot foresee
@triton.jit(do_not_specialize=["T"])
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, T, I, sg, su, so, KIND: tl.constexpr,
                     PRECISE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (t < T) & (c < I)
    g = tl.load(g_ptr + t * sg + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * su + c, mask=m, other=0.0).to(tl.float32)
    # F.silu: x / (1 + exp(-x)) in fp32 with an IEEE division, rounded to the dtype
    if PRECISE:
        e = libdevice.exp(-g)  # CUDA's expf, as torch's kernel (tl.exp is ex2.approx)
    else:
        e = tl.exp(-g)  # the interpreter (numpy) has no libdevice
    s = _round_to(tl.math.div_rn(g, 1.0 + e), KIND)
    y = _round_to(s * u, KIND)  # then the dtype multiply
    tl.store(out_ptr + t * so + c, y.to(out_ptr.dtype.element_ty), mask=m)


def silu_mul_split(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``: gate, up [T, I] (last dim contiguous) -> new [T, I]."""
    T, I = gate.shape
    assert up.shape == gate.shape and up.dtype == gate.dtype
    assert gate.stride(-1) == 1 and up.stride(-1) == 1
    out = torch.empty((T, I), dtype=gate.dtype, device=gate.device)
    if T == 0:
        return out
    BLOCK = min(triton.next_power_of_2(I), _TILE)
    ROWS = max(1, _TILE // BLOCK)
    _silu_mul_kernel[(triton.cdiv(T, ROWS), triton.cdiv(I, BLOCK))](
        gate, up, out, T, I, gate.stride(0), up.stride(0), out.stride(0), KIND=_kind(gate),
        PRECISE=not _interpreted(), ROWS=ROWS, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """gate_up [T, 2 I] (the fused gate/up GEMM output: gate columns first) -> silu(gate) * up
    [T, I]."""
    assert gate_up.shape[1] == 2 * intermediate
    return silu_mul_split(gate_up[:, :intermediate], gate_up[:, intermediate:])
