"""A fused C++ residual add + RMSNorm for fp32 CPU tensors, compiled at first use.

``add_rms_norm(x, residual, weight, eps)``: x, residual [T, N] fp32, weight [N] fp32 ->
(out [T, N], stream [T, N]) with stream = residual + x (residual None: stream is x itself)
and out = stream * rsqrt(mean(stream^2) + eps) * weight: the contract of
``ref_layer_ops.fused_add_rms_norm`` for fp32. Why it exists: on CPU, ``F.rms_norm`` in fp32
runs as a composite (``aten::_fused_rms_norm`` -> pow, mean (sum + div), add, rsqrt, two
muls: about six passes and as many dispatches, ~54 us a call at one decode token), 61 calls
per SmolLM2 decode step, ~5 % of a batch-1 step. Here one row is one pass for the add and
the sum of squares (16-lane fp32 accumulators, AVX-512 FMA) and one pass for the two
multiplies, with no temporaries and one dispatch.

Rounding: the add and the two multiplies round as torch's ops do (``stream * rstd`` rounded,
then ``* weight`` rounded; rstd = 1 / sqrt(mean + eps) like torch's vectorised rsqrt, mean =
sum / N); only the sum of squares is summed in another order than torch's cascade sum, so
rstd can differ in its last bit and an output by a few fp32 ulps (the tolerance the Triton
kernel's tests hold fp32 RMSNorm to; tests/kernels/test_rms_norm_cpu_fused.py). The stream is
bitwise torch's ``residual + x``.

Rows are split over torch's threads (``at::parallel_for``). A scalar path (no intrinsics)
covers machines without AVX-512; ``generic=True`` forces it (the tests run both). Built like
``paged_decode_cpu_fused`` (``load_inline``, ``-O3 -march=native``, cached by torch under
``TORCH_EXTENSIONS_DIR``, the CPU capability in the name). When it cannot be built or
``SPARSESERVE_CPU_NORM=torch`` is set, ``available()`` is False and ``model.layers.rms_norm``
keeps ``F.rms_norm``; ``set_enabled`` switches it in-process for A/B runs.
"""
from __future__ import annotations

import torch

from .cpu_extension import CpuExtension

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// torch's rsqrt on CPU: 1 / sqrt, each correctly rounded (Vectorized<float>::rsqrt)
inline float inv_rms(float sumsq, int64_t N, float eps) {
  const float mean = sumsq / static_cast<float>(N);
  return 1.0f / std::sqrt(mean + eps);
}

// one row, any N: s = r + x (stored to res when r is given), out = (s * rstd) * w
void row_generic(const float* x, const float* r, const float* w, float* out, float* res,
                 int64_t N, float eps) {
  float acc[16] = {0};  // 16 partial sums, as the vector path keeps them
  for (int64_t i = 0; i < N; ++i) {
    const float s = r ? r[i] + x[i] : x[i];
    if (r) res[i] = s;
    acc[i & 15] += s * s;
  }
  float sumsq = 0.0f;
  for (int j = 0; j < 16; ++j) sumsq += acc[j];
  const float rstd = inv_rms(sumsq, N, eps);
  const float* s = r ? res : x;
  for (int64_t i = 0; i < N; ++i) {
    const float n = s[i] * rstd;  // rounded before the weight multiply, like torch
    out[i] = n * w[i];
  }
}

#if defined(__AVX512F__)
inline __mmask16 tail(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

void row_avx512(const float* x, const float* r, const float* w, float* out, float* res,
                int64_t N, float eps) {
  // two accumulators: the FMA chain of one would bound the pass by its latency
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= N; i += 32) {
    __m512 s0 = _mm512_loadu_ps(x + i), s1 = _mm512_loadu_ps(x + i + 16);
    if (r) {
      s0 = _mm512_add_ps(_mm512_loadu_ps(r + i), s0);
      s1 = _mm512_add_ps(_mm512_loadu_ps(r + i + 16), s1);
      _mm512_storeu_ps(res + i, s0);
      _mm512_storeu_ps(res + i + 16, s1);
    }
    a0 = _mm512_fmadd_ps(s0, s0, a0);
    a1 = _mm512_fmadd_ps(s1, s1, a1);
  }
  for (; i < N; i += 16) {  // masked tail: any N
    const __mmask16 m = tail(N - i);
    __m512 s = _mm512_maskz_loadu_ps(m, x + i);
    if (r) {
      s = _mm512_add_ps(_mm512_maskz_loadu_ps(m, r + i), s);
      _mm512_mask_storeu_ps(res + i, m, s);
    }
    a0 = _mm512_fmadd_ps(s, s, a0);
  }
  const float rstd = inv_rms(_mm512_reduce_add_ps(_mm512_add_ps(a0, a1)), N, eps);
  const __m512 vr = _mm512_set1_ps(rstd);
  const float* src = r ? res : x;  // the row is still in L1 (N * 4 bytes)
  for (i = 0; i < N; i += 16) {
    const __mmask16 m = tail(N - i);
    const __m512 n = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + i), vr);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(n, _mm512_maskz_loadu_ps(m, w + i)));
  }
}
#endif

}  // namespace

bool has_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x [..., N], residual (optional) like x, weight [N], all fp32 -> (out, stream) shaped like x;
// the reshapes are done here: from Python each costs a dispatch (~1 us), the kernel 0.1 us
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x_in, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps, bool generic) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x: [..., N] fp32 CPU");
  const int64_t N = x_in.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == N && weight.scalar_type() == at::kFloat
              && weight.device().is_cpu(), "weight: [N] fp32 CPU");
  weight = weight.contiguous();
  torch::Tensor x = x_in.reshape({-1, N}).contiguous();
  const int64_t T = x.size(0);
  const bool has_r = residual.has_value() && residual->defined();
  torch::Tensor r, res = x_in;  // no residual: the stream is x itself, not copied
  const float* rp = nullptr;
  if (has_r) {
    TORCH_CHECK(residual->sizes() == x_in.sizes() && residual->scalar_type() == at::kFloat
                && residual->device().is_cpu(), "residual: fp32 CPU, shaped like x");
    r = residual->reshape({-1, N}).contiguous();
    rp = r.data_ptr<float>();
    res = torch::empty_like(x);
  }
  torch::Tensor out = torch::empty_like(x);
  if (T == 0 || N == 0) return {out.view(x_in.sizes()), has_r ? res.view(x_in.sizes()) : res};
  using RowFn = void (*)(const float*, const float*, const float*, float*, float*, int64_t, float);
  RowFn fn = row_generic;
#if defined(__AVX512F__)
  if (!generic) fn = row_avx512;
#endif
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = has_r ? res.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  // a thread gets at least ~32K elements: below that the fork costs more than the rows
  const int64_t grain = std::max<int64_t>(1, 32768 / N);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      fn(xp + t * N, rp ? rp + t * N : nullptr, wp, op + t * N, sp ? sp + t * N : nullptr, N, e);
  });
  return {out.view(x_in.sizes()), has_r ? res.view(x_in.sizes()) : res};
}
"""

# no FP contraction: s * rstd * w must round twice, as torch's two multiplies do
_EXT = CpuExtension("sparseserve_rms_norm_cpu_v2", _SOURCE, ["add_rms_norm", "has_avx512"],
                   "SPARSESERVE_CPU_NORM", "fused CPU add + RMSNorm kernel",
                   ("-ffp-contract=off",))
set_enabled = _EXT.set_enabled  # A/B switch (benchmarks/cpu_*_fused.py)
available = _EXT.available
vectorised = _EXT.vectorised


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``add_rms_norm`` should take x [..., N] and weight [N]: fp32 CPU tensors, no
    autograd (inference only: the kernel has no backward), built and enabled."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.is_cpu
            and weight.is_cpu and _EXT.available()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, generic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] fp32 CPU, residual like x or None, weight [N] -> (RMSNorm(stream) [..., N],
    stream [..., N]), stream = residual + x (None: x itself, not copied). New tensors (inputs
    are not written). ``generic`` forces the scalar path. Call ``usable`` first."""
    mod = _EXT.module or _EXT.get()
    if mod is None:
        raise RuntimeError("the fused CPU RMSNorm kernel is not built (see usable())")
    out, stream = mod.add_rms_norm(x, residual, weight, float(eps), generic)
    return out, stream
