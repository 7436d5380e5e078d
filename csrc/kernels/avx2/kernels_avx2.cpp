// AVX2 + FMA kernels. Compiled with those flags only; chosen at import when the CPU has them
// and lacks AVX-512.
#include <immintrin.h>

#include "kernels/std_includes.h"

namespace pyattn {
namespace avx2 {

#include "frame/common.h"
#include "kernels/x86_transpose.h"

// Lanes [0, n) of a vector of L lanes of width W bytes, as a maskload/maskstore mask.
static inline __m256i lane_mask32(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline __m256i lane_mask64(int n) {
  return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
}
static inline int clamp_lanes(int n, int lo, int width) {
  n -= lo;
  return n < 0 ? 0 : (n > width ? width : n);
}

// ------------------------------------------------------------------ float32: 6 x 16 tile
// 12 accumulators + 2 B vectors + 1 broadcast = 15 of the 16 ymm registers.
template <int M>
static inline void sgemm_ukernel_6x16_avx2_m(index_t k, const float* a, index_t rsa, index_t csa, const float* b,
                                             index_t ldb, float* c, index_t ldc, int nr, bool accumulate) {
  __m256 c0[M], c1[M];
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (index_t p = 0; p < k; ++p) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
    for (int r = 0; r < M; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * rsa);
      c0[r] = _mm256_fmadd_ps(ar, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(ar, b1, c1[r]);
    }
    a += csa;
    b += ldb;
  }
  if (nr == 16) {
#pragma GCC unroll 6
    for (int r = 0; r < M; ++r) {
      float* cr = c + r * ldc;
      if (accumulate) {
        c0[r] = _mm256_add_ps(c0[r], _mm256_loadu_ps(cr));
        c1[r] = _mm256_add_ps(c1[r], _mm256_loadu_ps(cr + 8));
      }
      _mm256_storeu_ps(cr, c0[r]);
      _mm256_storeu_ps(cr + 8, c1[r]);
    }
    return;
  }
  const __m256i m0 = lane_mask32(clamp_lanes(nr, 0, 8)), m1 = lane_mask32(clamp_lanes(nr, 8, 8));
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) {
    float* cr = c + r * ldc;
    if (accumulate) {
      c0[r] = _mm256_add_ps(c0[r], _mm256_maskload_ps(cr, m0));
      c1[r] = _mm256_add_ps(c1[r], _mm256_maskload_ps(cr + 8, m1));
    }
    _mm256_maskstore_ps(cr, m0, c0[r]);
    _mm256_maskstore_ps(cr + 8, m1, c1[r]);
  }
}

// ------------------------------------------------------------------ float64: 6 x 8 tile
template <int M>
static inline void dgemm_ukernel_6x8_avx2_m(index_t k, const double* a, index_t rsa, index_t csa, const double* b,
                                            index_t ldb, double* c, index_t ldc, int nr, bool accumulate) {
  __m256d c0[M], c1[M];
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) c0[r] = c1[r] = _mm256_setzero_pd();
  for (index_t p = 0; p < k; ++p) {
    const __m256d b0 = _mm256_loadu_pd(b), b1 = _mm256_loadu_pd(b + 4);
#pragma GCC unroll 6
    for (int r = 0; r < M; ++r) {
      const __m256d ar = _mm256_broadcast_sd(a + r * rsa);
      c0[r] = _mm256_fmadd_pd(ar, b0, c0[r]);
      c1[r] = _mm256_fmadd_pd(ar, b1, c1[r]);
    }
    a += csa;
    b += ldb;
  }
  const __m256i m0 = lane_mask64(clamp_lanes(nr, 0, 4)), m1 = lane_mask64(clamp_lanes(nr, 4, 4));
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) {
    double* cr = c + r * ldc;
    if (accumulate) {
      c0[r] = _mm256_add_pd(c0[r], _mm256_maskload_pd(cr, m0));
      c1[r] = _mm256_add_pd(c1[r], _mm256_maskload_pd(cr + 4, m1));
    }
    _mm256_maskstore_pd(cr, m0, c0[r]);
    _mm256_maskstore_pd(cr + 4, m1, c1[r]);
  }
}

// exp2 for x <= 128 (float) / 1024 (double): x = n + f, |f| <= 1/2, 2^f by a Taylor polynomial
// in f*ln2, 2^n built in the exponent field. Inputs below the smallest normal's exponent give 0
// (exactly 0 for -inf); NaN stays NaN.
static inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);  // operand order keeps NaN
  x = _mm256_min_ps(_mm256_set1_ps(128.0f), x);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(float(kExp2Taylor[7]));
#pragma GCC unroll 7
  for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(float(kExp2Taylor[i])));
  // n = -127 gives a zero exponent field, i.e. 0; n = 128 gives +inf.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256d exp2_pd(__m256d x) {
  x = _mm256_max_pd(_mm256_set1_pd(-1023.0), x);
  x = _mm256_min_pd(_mm256_set1_pd(1024.0), x);
  const __m256d n = _mm256_round_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256d f = _mm256_sub_pd(x, n);
  __m256d p = _mm256_set1_pd(kExp2Taylor[13]);
#pragma GCC unroll 13
  for (int i = 12; i >= 0; --i) p = _mm256_fmadd_pd(p, f, _mm256_set1_pd(kExp2Taylor[i]));
  const __m256i ni = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n));
  const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(ni, _mm256_set1_epi64x(1023)), 52);
  return _mm256_mul_pd(p, _mm256_castsi256_pd(e));
}

template <class T, class V, int L, V (*Exp)(V), V (*Load)(const T*), void (*Store)(T*, V), V (*Sub)(V, V),
          V (*Add)(V, V), V (*Set1)(T), V (*Fma)(V, V, V)>
struct ExpAvx2 {
  //   q . k, the row read in order
  static T dot1(const T* q, const T* k, index_t n) {
    V a0 = Set1(T(0)), a1 = a0;
    index_t e = 0;
    for (; e + 2 * L <= n; e += 2 * L) {
      a0 = Fma(Load(q + e), Load(k + e), a0);
      a1 = Fma(Load(q + e + L), Load(k + e + L), a1);
    }
    for (; e + L <= n; e += L) a0 = Fma(Load(q + e), Load(k + e), a0);
    alignas(32) T lanes[L];
    Store(lanes, Add(a0, a1));
    T t = T(0);
    for (int j = 0; j < L; ++j) t += lanes[j];
    for (; e < n; ++e) t += q[e] * k[e];
    return t;
  }
  //   x[i] = exp2(x[i] - sub[i]); sum[i] += x[i]
  static void exp2_sub_cols(T* x, const T* sub, T* sum, int n) {
    int i = 0;
    for (; i + L <= n; i += L) {
      const V e = Exp(Sub(Load(x + i), Load(sub + i)));
      Store(x + i, e);
      Store(sum + i, Add(Load(sum + i), e));
    }
    for (; i < n; ++i) {
      x[i] = T(std::exp2(x[i] - sub[i]));
      sum[i] += x[i];
    }
  }
  //   x[i] = exp2(x[i] - sub); return sum(x)
  static T exp2_sub_sum(T* x, index_t n, T sub) {
    const V s = Set1(sub);
    V acc = Set1(T(0));
    index_t i = 0;
    for (; i + L <= n; i += L) {
      const V e = Exp(Sub(Load(x + i), s));
      Store(x + i, e);
      acc = Add(acc, e);
    }
    alignas(32) T lanes[L];
    Store(lanes, acc);
    T total = T(0);
    for (int j = 0; j < L; ++j) total += lanes[j];
    for (; i < n; ++i) {
      x[i] = T(std::exp2(x[i] - sub));
      total += x[i];
    }
    return total;
  }
};

static inline __m256 ld_ps(const float* p) { return _mm256_loadu_ps(p); }
static inline void st_ps(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline __m256 sub_ps(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
static inline __m256 add_ps(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
static inline __m256 set1_ps(float v) { return _mm256_set1_ps(v); }
static inline __m256 fma_ps(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
static inline __m256d ld_pd(const double* p) { return _mm256_loadu_pd(p); }
static inline void st_pd(double* p, __m256d v) { _mm256_storeu_pd(p, v); }
static inline __m256d sub_pd(__m256d a, __m256d b) { return _mm256_sub_pd(a, b); }
static inline __m256d add_pd(__m256d a, __m256d b) { return _mm256_add_pd(a, b); }
static inline __m256d set1_pd(double v) { return _mm256_set1_pd(v); }
static inline __m256d fma_pd(__m256d a, __m256d b, __m256d c) { return _mm256_fmadd_pd(a, b, c); }

#include "frame/rowops.h"

struct OpsAvx2F32 {
  using Mask = __m256i;
  static Mask mask(int n) { return lane_mask32(n); }
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 maskload(Mask m, const float* p) { return _mm256_maskload_ps(p, m); }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static void maskstore(Mask m, float* p, __m256 v) { _mm256_maskstore_ps(p, m, v); }
  static __m256 set1(float v) { return _mm256_set1_ps(v); }
  static __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
};
struct OpsAvx2F64 {
  using Mask = __m256i;
  static Mask mask(int n) { return lane_mask64(n); }
  static __m256d load(const double* p) { return _mm256_loadu_pd(p); }
  static __m256d maskload(Mask m, const double* p) { return _mm256_maskload_pd(p, m); }
  static void store(double* p, __m256d v) { _mm256_storeu_pd(p, v); }
  static void maskstore(Mask m, double* p, __m256d v) { _mm256_maskstore_pd(p, m, v); }
  static __m256d set1(double v) { return _mm256_set1_pd(v); }
  static __m256d fma(__m256d a, __m256d b, __m256d c) { return _mm256_fmadd_pd(a, b, c); }
};

#define PYATTN_UKERNEL_SWITCH(NAME)                                     \
  switch (mr) {                                                         \
    case 6: return NAME<6>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc);    \
    case 5: return NAME<5>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc);    \
    case 4: return NAME<4>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc);    \
    case 3: return NAME<3>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc);    \
    case 2: return NAME<2>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc);    \
    default: return NAME<1>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc);   \
  }

// Block sizes: 6 x KC A micro-panel (6 KiB) in L1, KC x NC packed B (512 KiB) in L2.
struct sgemm_6x16_avx2 : ExpAvx2<float, __m256, 8, exp2_ps, ld_ps, st_ps, sub_ps, add_ps, set1_ps, fma_ps> {
  using T = float;
  static constexpr int MR = 6, NR = 16, NP = 4;
  static constexpr index_t MC = 120, KC = 256, NC = 512, BK = 256;
  static void pack_a_rows(const T* a, index_t rsa, index_t kc, T* dst) {
    pack_a_rows_ref<T, MR>(a, rsa, kc, dst);
  }
  static void pv_rows(const T* p, index_t ps, index_t R, index_t kb, const T* v, index_t v_rs, index_t Ev, T* acc) {
    pv_rows_impl<T, __m256, 8, OpsAvx2F32>(p, ps, R, kb, v, v_rs, Ev, acc);
  }
  static void transpose(const T* src, index_t srs, index_t rows, index_t cols, T* dst, index_t drs) {
    transpose_ps(src, srs, rows, cols, dst, drs);
  }
  static void ukernel(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                      index_t ldc, int nr, bool acc) {
    PYATTN_UKERNEL_SWITCH(sgemm_ukernel_6x16_avx2_m)
  }
};
struct dgemm_6x8_avx2 : ExpAvx2<double, __m256d, 4, exp2_pd, ld_pd, st_pd, sub_pd, add_pd, set1_pd, fma_pd> {
  using T = double;
  static constexpr int MR = 6, NR = 8, NP = 4;
  static constexpr index_t MC = 120, KC = 256, NC = 256, BK = 128;
  static void pack_a_rows(const T* a, index_t rsa, index_t kc, T* dst) {
    pack_a_rows_ref<T, MR>(a, rsa, kc, dst);
  }
  static void pv_rows(const T* p, index_t ps, index_t R, index_t kb, const T* v, index_t v_rs, index_t Ev, T* acc) {
    pv_rows_impl<T, __m256d, 4, OpsAvx2F64>(p, ps, R, kb, v, v_rs, Ev, acc);
  }
  static void transpose(const T* src, index_t srs, index_t rows, index_t cols, T* dst, index_t drs) {
    transpose_ref<T>(src, srs, rows, cols, dst, drs);
  }
  static void ukernel(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                      index_t ldc, int nr, bool acc) {
    PYATTN_UKERNEL_SWITCH(dgemm_ukernel_6x8_avx2_m)
  }
};
#undef PYATTN_UKERNEL_SWITCH

#include "frame/instantiate.h"

}  // namespace avx2

const IsaTable isa_avx2 = avx2::make_table<avx2::sgemm_6x16_avx2, avx2::dgemm_6x8_avx2>("avx2");

}  // namespace pyattn
