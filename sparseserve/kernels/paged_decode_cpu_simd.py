"""The vector tasks of the fused CPU paged decode attention (kernels/paged_decode_cpu_fused.py,
whose module docstring describes them): one (request, KV head) task per vector ISA, as C++
source spliced into that extension inside its anonymous namespace, after `Args`, `row_tokens`
and `TaskFn`. AVX-512 (16 lanes, the queries and outputs in registers) where the compiler
targets it, else AVX2 + FMA (8 lanes, the queries in L1, the outputs in column blocks); either
defines VECTOR_TASK (a template <int G, int C> task, D = C vectors), which the extension's
`pick_g` instantiates for G = 1..8 query heads per KV head. Neither: the scalar task only."""

VECTOR_TASKS = r"""
#if defined(__AVX512F__)
// exp(x) for finite x <= 0: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 Taylor
// polynomial (relative error < 2e-7), times 2^n by scalef (underflows cleanly to 0)
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);         // ln2 hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);               // ln2 lo
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// the 16-lane sums of four vectors as one 4-lane vector: 13 shuffles and adds where four
// separate reductions take ~32 (the score pass's main cost once K is in cache)
inline __m128 hsum4(const __m512* a) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // per 128-bit lane: [a0, a1, a2, a3] partial sums
  const __m512 u = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
  const __m512 v = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 w = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(w);
}

// G query heads, D = 16 * C: the G x C query vectors and the G x C output accumulators are
// compile-time arrays the compiler keeps in zmm registers (G 3, D 64: 24 of 32)
template <int G, int C>
void task_avx512(const Args& a, int64_t b, int64_t h, std::vector<float>& s) {
  constexpr int64_t D = 16 * C;
  const int64_t ps = a.ps;
  const int64_t n = row_tokens(a, b, h), np = a.npages[b * a.Hkv + h];
  const int32_t* tbl = a.table + (b * a.Hkv + h) * a.W;
  const float* q = a.q + (b * a.Hq + h * G) * D;
  s.resize(G * n + 16);
  float* sp = s.data();
  __m512 qv[G][C];
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + c * 16), sc);
  // scores: one read of each K row (then from L1 for the other queries), G dot products;
  // four rows per iteration, their horizontal sums done together (hsum4)
  for (int64_t j = 0, i = 0; j < np; ++j) {
    const int64_t nt = j == np - 1 ? n - (np - 1) * ps : ps;
    const float* kp = a.k + int64_t(tbl[j]) * ps * D;
    // the next page is anywhere in the cache (no stride for the hardware prefetcher): ask for
    // its rows while this page's are used
    const float* kn = j + 1 < np ? a.k + int64_t(tbl[j + 1]) * ps * D : kp;
    int64_t t = 0;
    for (; t + 3 < nt; t += 4, i += 4) {
      for (int64_t x = 0; x < 4 * D; x += 16) _mm_prefetch((const char*)(kn + t * D + x), _MM_HINT_T0);
      for (int g = 0; g < G; ++g) {
        __m512 acc4[4];
        for (int r = 0; r < 4; ++r) {
          const float* kr = kp + (t + r) * D;
          acc4[r] = _mm512_mul_ps(qv[g][0], _mm512_loadu_ps(kr));
          for (int c = 1; c < C; ++c) acc4[r] = _mm512_fmadd_ps(qv[g][c], _mm512_loadu_ps(kr + c * 16), acc4[r]);
        }
        _mm_storeu_ps(sp + g * n + i, hsum4(acc4));
      }
    }
    for (; t < nt; ++t, ++i) {
      __m512 k0[C];
      for (int c = 0; c < C; ++c) k0[c] = _mm512_loadu_ps(kp + t * D + c * 16);
      for (int g = 0; g < G; ++g) {
        __m512 a0 = _mm512_mul_ps(qv[g][0], k0[0]);
        for (int c = 1; c < C; ++c) a0 = _mm512_fmadd_ps(qv[g][c], k0[c], a0);
        sp[g * n + i] = _mm512_reduce_add_ps(a0);
      }
    }
  }
  // softmax numerators in place, 16 scores at a time (masked tail)
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* sg = sp + g * n;
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + i));
    const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
    m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, sg + i));
    const __m512 mb = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 l = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + i), mb));
      _mm512_storeu_ps(sg + i, e);
      l = _mm512_add_ps(l, e);
    }
    if (tail) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + i), mb));
      _mm512_mask_storeu_ps(sg + i, tail, e);
      l = _mm512_mask_add_ps(l, tail, l, e);
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(l);
  }
  // outputs: one read of each V row, G weighted accumulations
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0, i = 0; j < np; ++j) {
    const int64_t nt = j == np - 1 ? n - (np - 1) * ps : ps;
    const float* vp = a.v + int64_t(tbl[j]) * ps * D;
    const float* vn = j + 1 < np ? a.v + int64_t(tbl[j + 1]) * ps * D : vp;
    for (int64_t t = 0; t < nt; ++t, ++i) {
      for (int64_t x = 0; x < D; x += 16) _mm_prefetch((const char*)(vn + t * D + x), _MM_HINT_T0);
      __m512 vr[C];
      for (int c = 0; c < C; ++c) vr[c] = _mm512_loadu_ps(vp + t * D + c * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(sp[g * n + i]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vr[c], acc[g][c]);
      }
    }
  }
  float* o = a.out + (b * a.Hq + h * G) * D;
  for (int g = 0; g < G; ++g) {
    const __m512 iv = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + g * D + c * 16, _mm512_mul_ps(acc[g][c], iv));
  }
}

#define VECTOR_TASK task_avx512
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The AVX2 + FMA path (8 lanes, 16 registers): the AVX-512 path's structure where the
// registers allow it. exp(x) for x <= 0 as exp512 (Cody-Waite, degree-6 polynomial), 2^n built
// in the exponent bits; x < -87 (2^n below the normal range) gives 0, which the AVX-512
// path's scalef reaches by underflow too
inline __m256 exp256(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// the 8-lane sums of four vectors as one 4-lane vector (the score pass, four rows at once)
inline __m128 hsum4_256(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);  // per 128-bit half: a0 a0 a1 a1 partials
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 u = _mm256_hadd_ps(t0, t1);       // per half: a0 a1 a2 a3
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

inline float hsum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_hadd_ps(x, x);
  return _mm_cvtss_f32(_mm_hadd_ps(x, x));
}

// G query heads, D = 8 * C. Scores: the pre-scaled queries stay in L1 (G x C vectors do not
// fit 16 registers), each K row is read once from memory, four rows per iteration. Outputs:
// the D columns in blocks of CB vectors, G x CB accumulators in registers per block (V rows
// re-read per block from L1/L2: a page is 32 x D floats)
template <int G, int C>
void task_avx2(const Args& a, int64_t b, int64_t h, std::vector<float>& s) {
  constexpr int64_t D = 8 * C;
  constexpr int CB = G <= 3 ? 4 : G <= 6 ? 2 : 1;
  static_assert(C % CB == 0, "column blocks divide the head");
  const int64_t ps = a.ps;
  const int64_t n = row_tokens(a, b, h), np = a.npages[b * a.Hkv + h];
  const int32_t* tbl = a.table + (b * a.Hkv + h) * a.W;
  const float* q = a.q + (b * a.Hq + h * G) * D;
  s.resize(G * n + 8);
  float* sp = s.data();
  alignas(32) float qs[G * D];
  for (int64_t x = 0; x < G * D; ++x) qs[x] = q[x] * a.scale;
  for (int64_t j = 0, i = 0; j < np; ++j) {
    const int64_t nt = j == np - 1 ? n - (np - 1) * ps : ps;
    const float* kp = a.k + int64_t(tbl[j]) * ps * D;
    const float* kn = j + 1 < np ? a.k + int64_t(tbl[j + 1]) * ps * D : kp;
    int64_t t = 0;
    for (; t + 3 < nt; t += 4, i += 4) {
      for (int64_t x = 0; x < 4 * D; x += 16) _mm_prefetch((const char*)(kn + t * D + x), _MM_HINT_T0);
      for (int g = 0; g < G; ++g) {
        __m256 acc4[4];
        for (int r = 0; r < 4; ++r) {
          const float* kr = kp + (t + r) * D;
          acc4[r] = _mm256_mul_ps(_mm256_load_ps(qs + g * D), _mm256_loadu_ps(kr));
          for (int c = 1; c < C; ++c)
            acc4[r] = _mm256_fmadd_ps(_mm256_load_ps(qs + g * D + c * 8), _mm256_loadu_ps(kr + c * 8), acc4[r]);
        }
        _mm_storeu_ps(sp + g * n + i, hsum4_256(acc4));
      }
    }
    for (; t < nt; ++t, ++i)
      for (int g = 0; g < G; ++g) {
        const float* kr = kp + t * D;
        __m256 a0 = _mm256_mul_ps(_mm256_load_ps(qs + g * D), _mm256_loadu_ps(kr));
        for (int c = 1; c < C; ++c)
          a0 = _mm256_fmadd_ps(_mm256_load_ps(qs + g * D + c * 8), _mm256_loadu_ps(kr + c * 8), a0);
        sp[g * n + i] = hsum256(a0);
      }
  }
  // softmax numerators in place, 8 at a time, the tail through a zero-padded copy
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* sg = sp + g * n;
    float mx = -INFINITY;
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sg + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (int x = 0; x < 8; ++x) mx = std::max(mx, lanes[x]);
    for (int64_t x = i; x < n; ++x) mx = std::max(mx, sg[x]);
    const __m256 mb = _mm256_set1_ps(mx);
    __m256 l = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + i), mb));
      _mm256_storeu_ps(sg + i, e);
      l = _mm256_add_ps(l, e);
    }
    float sum = hsum256(l);
    if (i < n) {
      alignas(32) float tail[8];
      for (int x = 0; x < 8; ++x) tail[x] = i + x < n ? sg[i + x] - mx : -INFINITY;
      _mm256_store_ps(tail, exp256(_mm256_load_ps(tail)));
      for (int64_t x = i; x < n; ++x) { sg[x] = tail[x - i]; sum += tail[x - i]; }
    }
    inv[g] = 1.f / sum;
  }
  float* o = a.out + (b * a.Hq + h * G) * D;
  for (int c0 = 0; c0 < C; c0 += CB) {
    __m256 acc[G][CB];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CB; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0, i = 0; j < np; ++j) {
      const int64_t nt = j == np - 1 ? n - (np - 1) * ps : ps;
      const float* vp = a.v + int64_t(tbl[j]) * ps * D + c0 * 8;
      for (int64_t t = 0; t < nt; ++t, ++i) {
        __m256 vr[CB];
        for (int c = 0; c < CB; ++c) vr[c] = _mm256_loadu_ps(vp + t * D + c * 8);
        for (int g = 0; g < G; ++g) {
          const __m256 p = _mm256_broadcast_ss(sp + g * n + i);
          for (int c = 0; c < CB; ++c) acc[g][c] = _mm256_fmadd_ps(p, vr[c], acc[g][c]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 iv = _mm256_set1_ps(inv[g]);
      for (int c = 0; c < CB; ++c)
        _mm256_storeu_ps(o + g * D + (c0 + c) * 8, _mm256_mul_ps(acc[g][c], iv));
    }
  }
}

#define VECTOR_TASK task_avx2
#endif
"""
