// AVX-512 kernels (F/DQ/BW/VL). Compiled with those flags only; chosen at import when the CPU
// has them.
#include <immintrin.h>

#include "kernels/std_includes.h"

namespace pyattn {
namespace avx512 {

#include "frame/common.h"
#include "kernels/x86_transpose.h"

// ------------------------------------------------------------------ float32: 8 x 48 tile
// 8 rows of A are broadcast, 3 vectors of 16 B columns are loaded: 24 accumulators, 3 loads
// and 8 broadcasts per 24 FMAs, leaving 5 of the 32 zmm registers for the schedule.
template <int M>
static inline void sgemm_ukernel_8x48_avx512_m(index_t k, const float* a, index_t rsa, index_t csa,
                                               const float* b, index_t ldb, float* c, index_t ldc, int nr,
                                               bool accumulate) {
  __m512 c0[M], c1[M], c2[M];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) c0[r] = c1[r] = c2[r] = _mm512_setzero_ps();
  for (index_t p = 0; p < k; ++p) {
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r * rsa]);
      c0[r] = _mm512_fmadd_ps(ar, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(ar, b1, c1[r]);
      c2[r] = _mm512_fmadd_ps(ar, b2, c2[r]);
    }
    a += csa;
    b += ldb;
  }
  const int n0 = nr < 16 ? nr : 16, n1 = nr < 32 ? (nr > 16 ? nr - 16 : 0) : 16, n2 = nr > 32 ? nr - 32 : 0;
  const __mmask16 k0 = __mmask16((1u << n0) - 1), k1 = __mmask16((1u << n1) - 1), k2 = __mmask16((1u << n2) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) {
    float* cr = c + r * ldc;
    if (accumulate) {
      c0[r] = _mm512_add_ps(c0[r], _mm512_maskz_loadu_ps(k0, cr));
      c1[r] = _mm512_add_ps(c1[r], _mm512_maskz_loadu_ps(k1, cr + 16));
      c2[r] = _mm512_add_ps(c2[r], _mm512_maskz_loadu_ps(k2, cr + 32));
    }
    _mm512_mask_storeu_ps(cr, k0, c0[r]);
    _mm512_mask_storeu_ps(cr + 16, k1, c1[r]);
    _mm512_mask_storeu_ps(cr + 32, k2, c2[r]);
  }
}

// ------------------------------------------------------------------ float64: 8 x 24 tile
template <int M>
static inline void dgemm_ukernel_8x24_avx512_m(index_t k, const double* a, index_t rsa, index_t csa,
                                               const double* b, index_t ldb, double* c, index_t ldc, int nr,
                                               bool accumulate) {
  __m512d c0[M], c1[M], c2[M];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) c0[r] = c1[r] = c2[r] = _mm512_setzero_pd();
  for (index_t p = 0; p < k; ++p) {
    const __m512d b0 = _mm512_loadu_pd(b), b1 = _mm512_loadu_pd(b + 8), b2 = _mm512_loadu_pd(b + 16);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const __m512d ar = _mm512_set1_pd(a[r * rsa]);
      c0[r] = _mm512_fmadd_pd(ar, b0, c0[r]);
      c1[r] = _mm512_fmadd_pd(ar, b1, c1[r]);
      c2[r] = _mm512_fmadd_pd(ar, b2, c2[r]);
    }
    a += csa;
    b += ldb;
  }
  const int n0 = nr < 8 ? nr : 8, n1 = nr < 16 ? (nr > 8 ? nr - 8 : 0) : 8, n2 = nr > 16 ? nr - 16 : 0;
  const __mmask8 k0 = __mmask8((1u << n0) - 1), k1 = __mmask8((1u << n1) - 1), k2 = __mmask8((1u << n2) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) {
    double* cr = c + r * ldc;
    if (accumulate) {
      c0[r] = _mm512_add_pd(c0[r], _mm512_maskz_loadu_pd(k0, cr));
      c1[r] = _mm512_add_pd(c1[r], _mm512_maskz_loadu_pd(k1, cr + 8));
      c2[r] = _mm512_add_pd(c2[r], _mm512_maskz_loadu_pd(k2, cr + 16));
    }
    _mm512_mask_storeu_pd(cr, k0, c0[r]);
    _mm512_mask_storeu_pd(cr + 8, k1, c1[r]);
    _mm512_mask_storeu_pd(cr + 16, k2, c2[r]);
  }
}

// exp2 for x <= 128: x = n + f, |f| <= 1/2; 2^f by its degree-7 (float) or degree-13 (double)
// Taylor polynomial in f*ln2 (truncation below 0.1 ulp), then scalef multiplies by 2^n, which
// also gives exact 0 for -inf (clamped to -150 / -1100) and lets NaN through.
static inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);  // operand order keeps NaN
  x = _mm512_min_ps(_mm512_set1_ps(128.0f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(float(kExp2Taylor[7]));
#pragma GCC unroll 7
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(float(kExp2Taylor[i])));
  return _mm512_scalef_ps(p, n);
}

static inline __m512d exp2_pd(__m512d x) {
  x = _mm512_max_pd(_mm512_set1_pd(-1100.0), x);
  x = _mm512_min_pd(_mm512_set1_pd(1025.0), x);
  const __m512d n = _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512d f = _mm512_sub_pd(x, n);
  __m512d p = _mm512_set1_pd(kExp2Taylor[13]);
#pragma GCC unroll 13
  for (int i = 12; i >= 0; --i) p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(kExp2Taylor[i]));
  return _mm512_scalef_pd(p, n);
}

#include "frame/rowops.h"

struct OpsF32 {
  using Mask = __mmask16;
  static Mask mask(int n) { return n >= 16 ? Mask(0xFFFF) : Mask((1u << n) - 1); }
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 maskload(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
  static void maskstore(Mask m, float* p, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
  static __m512 set1(float v) { return _mm512_set1_ps(v); }
  static __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
};
struct OpsF64 {
  using Mask = __mmask8;
  static Mask mask(int n) { return n >= 8 ? Mask(0xFF) : Mask((1u << n) - 1); }
  static __m512d load(const double* p) { return _mm512_loadu_pd(p); }
  static __m512d maskload(Mask m, const double* p) { return _mm512_maskz_loadu_pd(m, p); }
  static void store(double* p, __m512d v) { _mm512_storeu_pd(p, v); }
  static void maskstore(Mask m, double* p, __m512d v) { _mm512_mask_storeu_pd(p, m, v); }
  static __m512d set1(double v) { return _mm512_set1_pd(v); }
  static __m512d fma(__m512d a, __m512d b, __m512d c) { return _mm512_fmadd_pd(a, b, c); }
};

struct ExpF32 {
  //   q . k, the row read in order
  static float dot1(const float* q, const float* k, index_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    index_t e = 0;
    for (; e + 32 <= n; e += 32) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), _mm512_loadu_ps(k + e), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + e + 16), _mm512_loadu_ps(k + e + 16), a1);
    }
    for (; e < n; e += 16) {
      const __mmask16 m = OpsF32::mask(int(n - e));
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + e), _mm512_maskz_loadu_ps(m, k + e), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
  static void pv_rows(const float* p, index_t ps, index_t R, index_t kb, const float* v, index_t v_rs, index_t Ev,
                      float* acc) {
    pv_rows_impl<float, __m512, 16, OpsF32>(p, ps, R, kb, v, v_rs, Ev, acc);
  }
  //   x[i] = exp2(x[i] - sub[i]); sum[i] += x[i]
  static void exp2_sub_cols(float* x, const float* sub, float* sum, int n) {
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
      const __m512 e = exp2_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, sub + i)));
      _mm512_mask_storeu_ps(x + i, m, e);
      _mm512_mask_storeu_ps(sum + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, sum + i), e));
    }
  }
  //   x[i] = exp2(x[i] - sub); return sum(x)
  static float exp2_sub_sum(float* x, index_t n, float sub) {
    const __m512 s = _mm512_set1_ps(sub);
    __m512 acc = _mm512_setzero_ps();
    for (index_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
      const __m512 e = exp2_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s));
      _mm512_mask_storeu_ps(x + i, m, e);
      acc = _mm512_mask_add_ps(acc, m, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
  }
};

struct ExpF64 {
  static double dot1(const double* q, const double* k, index_t n) {
    __m512d a0 = _mm512_setzero_pd(), a1 = a0;
    index_t e = 0;
    for (; e + 16 <= n; e += 16) {
      a0 = _mm512_fmadd_pd(_mm512_loadu_pd(q + e), _mm512_loadu_pd(k + e), a0);
      a1 = _mm512_fmadd_pd(_mm512_loadu_pd(q + e + 8), _mm512_loadu_pd(k + e + 8), a1);
    }
    for (; e < n; e += 8) {
      const __mmask8 m = OpsF64::mask(int(n - e));
      a0 = _mm512_fmadd_pd(_mm512_maskz_loadu_pd(m, q + e), _mm512_maskz_loadu_pd(m, k + e), a0);
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
  }
  static void pv_rows(const double* p, index_t ps, index_t R, index_t kb, const double* v, index_t v_rs,
                      index_t Ev, double* acc) {
    pv_rows_impl<double, __m512d, 8, OpsF64>(p, ps, R, kb, v, v_rs, Ev, acc);
  }
  static void exp2_sub_cols(double* x, const double* sub, double* sum, int n) {
    for (int i = 0; i < n; i += 8) {
      const __mmask8 m = n - i >= 8 ? __mmask8(0xFF) : __mmask8((1u << (n - i)) - 1);
      const __m512d e = exp2_pd(_mm512_sub_pd(_mm512_maskz_loadu_pd(m, x + i), _mm512_maskz_loadu_pd(m, sub + i)));
      _mm512_mask_storeu_pd(x + i, m, e);
      _mm512_mask_storeu_pd(sum + i, m, _mm512_add_pd(_mm512_maskz_loadu_pd(m, sum + i), e));
    }
  }
  static double exp2_sub_sum(double* x, index_t n, double sub) {
    const __m512d s = _mm512_set1_pd(sub);
    __m512d acc = _mm512_setzero_pd();
    for (index_t i = 0; i < n; i += 8) {
      const __mmask8 m = n - i >= 8 ? __mmask8(0xFF) : __mmask8((1u << (n - i)) - 1);
      const __m512d e = exp2_pd(_mm512_sub_pd(_mm512_maskz_loadu_pd(m, x + i), s));
      _mm512_mask_storeu_pd(x + i, m, e);
      acc = _mm512_mask_add_pd(acc, m, acc, e);
    }
    return _mm512_reduce_add_pd(acc);
  }
};

#define PYATTN_UKERNEL_SWITCH(NAME)                         \
  switch (mr) {                                             \
    case 8: return NAME<8>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc); \
    case 7: return NAME<7>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc); \
    case 6: return NAME<6>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc); \
    case 5: return NAME<5>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc); \
    case 4: return NAME<4>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc); \
    case 3: return NAME<3>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc); \
    case 2: return NAME<2>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc); \
    default: return NAME<1>(k, a, rsa, csa, b, ldb, c, ldc, nr, acc); \
  }

// Block sizes. GEMM sweep (2 threads, GFLOP/s, builds compared in one process; MC x KC x NC):
//                   240x128x480  240x192x480  240x256x480  240x384x480  240x256x240  240x256x960  480x256x480
//   512^3               172          178          180          185          181          181          182
//   2048^3              193          194          197          199          196          197          197
//   128x768x2304        183          185          189          183          182          184          186
//   2048x1024x4096      186          189          196          197          193          198          196
// KC below 256 pays for more C traffic and packing rounds; MC and NC barely matter once the
// blocks fit (L2 1 MiB per core), so the middle of the flat region is kept.
//  NP: query panels of NR per attention task; both panels reuse each K/V row from L1.
//  KC: an 8 x KC A micro-panel (8 KiB at KC = 256) stays in L1 across the NC/NR B panels;
//  NC: a KC x NC packed B block (480 KiB) stays in the 1 MiB L2;
//  BK: the BK x 48 score tile (24 KiB at 128) stays in L1 between the two attention GEMMs and
//      the softmax; swept single-threaded over 64..512 on L=2048, D=64/128: 128 was ~10% ahead
//      of 256 and within noise of 384/512, which no longer fit L1 with the Q^T tile.
struct sgemm_8x48_avx512 : ExpF32 {
  using T = float;
  static constexpr int MR = 8, NR = 48, NP = 2;
  static constexpr index_t MC = 240, KC = 256, NC = 480, BK = 128;
  //   dst[p*8 + r] = a[r*rsa + p]: the 8-row panel transposed in 8 x 8 register blocks
  static void pack_a_rows(const T* a, index_t rsa, index_t kc, T* dst) { transpose_ps(a, rsa, 8, kc, dst, 8); }
  static void transpose(const T* src, index_t srs, index_t rows, index_t cols, T* dst, index_t drs) {
    transpose_ps(src, srs, rows, cols, dst, drs);
  }
  static void ukernel(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                      index_t ldc, int nr, bool acc) {
    PYATTN_UKERNEL_SWITCH(sgemm_ukernel_8x48_avx512_m)
  }
};
struct dgemm_8x24_avx512 : ExpF64 {
  using T = double;
  static constexpr int MR = 8, NR = 24, NP = 2;
  static constexpr index_t MC = 120, KC = 256, NC = 240, BK = 128;
  static void pack_a_rows(const T* a, index_t rsa, index_t kc, T* dst) {
    pack_a_rows_ref<T, MR>(a, rsa, kc, dst);
  }
  static void transpose(const T* src, index_t srs, index_t rows, index_t cols, T* dst, index_t drs) {
    transpose_ref<T>(src, srs, rows, cols, dst, drs);
  }
  static void ukernel(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                      index_t ldc, int nr, bool acc) {
    PYATTN_UKERNEL_SWITCH(dgemm_ukernel_8x24_avx512_m)
  }
};
#undef PYATTN_UKERNEL_SWITCH

#include "frame/instantiate.h"

}  // namespace avx512

const IsaTable isa_avx512 = avx512::make_table<avx512::sgemm_8x48_avx512, avx512::dgemm_8x24_avx512>("avx512");

}  // namespace pyattn
