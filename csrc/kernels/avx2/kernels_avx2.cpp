// AVX2 + FMA kernels. Compiled with those flags only; chosen at import when the CPU has them
// and lacks AVX-512. The schedules are in kernels/x86_simd.h; this file supplies the vectors.
#include <immintrin.h>

#include "kernels/std_includes.h"

namespace pyattn {
namespace avx2 {

#include "frame/common.h"
#include "kernels/x86_transpose.h"

// exp2 for x <= 128 (float) / 1024 (double): x = n + f, |f| <= 1/2, 2^f by a Taylor polynomial
// in f*ln2, 2^n built in the exponent field. x below the smallest normal exponent, -126 (-1022),
// gives 0, never a subnormal (common.h, kExp2Floor): a kept x rounds to n >= -126 with f >= 0 at
// n = -126, a normal product. NaN stays NaN (the ordered compare is false for it, and max with x
// second returns it).
static inline __m256 exp2_ps(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(float(kExp2Floor<float>)), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(float(kExp2Floor<float>)), x);
  x = _mm256_min_ps(_mm256_set1_ps(128.0f), x);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(float(kExp2Taylor[7]));
#pragma GCC unroll 7
  for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(float(kExp2Taylor[i])));
  // n = 128 gives +inf.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline __m256d exp2_pd(__m256d x) {
  const __m256d under = _mm256_cmp_pd(x, _mm256_set1_pd(double(kExp2Floor<double>)), _CMP_LT_OQ);
  x = _mm256_max_pd(_mm256_set1_pd(double(kExp2Floor<double>)), x);
  x = _mm256_min_pd(_mm256_set1_pd(1024.0), x);
  const __m256d n = _mm256_round_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256d f = _mm256_sub_pd(x, n);
  __m256d p = _mm256_set1_pd(kExp2Taylor[13]);
#pragma GCC unroll 13
  for (int i = 12; i >= 0; --i) p = _mm256_fmadd_pd(p, f, _mm256_set1_pd(kExp2Taylor[i]));
  const __m256i ni = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n));
  const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(ni, _mm256_set1_epi64x(1023)), 52);
  return _mm256_andnot_pd(under, _mm256_mul_pd(p, _mm256_castsi256_pd(e)));
}

// Horizontal sums (no single instruction on AVX2).
//   ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): sum_lanes's order, so that a key's score
//   summed key by key has the bits of the same score summed L keys at a time (single-uop
//   shuffles: two vhaddps, 3-4 uops each, made the streamed key-by-key decode 3-6% slower)
static inline float hsum_ps(__m256 v) {
  v = _mm256_add_ps(v, _mm256_movehdup_ps(v));                          // v0 + v1, v2 + v3 per half
  v = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));  // (v0 + v1) + (v2 + v3)
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}
static inline double hsum_pd(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

struct OpsF32 {
  using T = float;
  using V = __m256;
  using Mask = __m256i;
  static constexpr int L = 8;
  static constexpr int kRegs = 16;  // ymm0-15
  // Lanes [0, n): maskload/maskstore touch no memory outside them.
  static Mask mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load(const T* p) { return _mm256_loadu_ps(p); }
  static V maskload(Mask m, const T* p) { return _mm256_maskload_ps(p, m); }
  static void store(T* p, V v) { _mm256_storeu_ps(p, v); }
  static void maskstore(Mask m, T* p, V v) { _mm256_maskstore_ps(p, m, v); }
  static V set1(T v) { return _mm256_set1_ps(v); }
  static V zero() { return _mm256_setzero_ps(); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static T reduce_max(V v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V abs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static V copysign(V mag, V sgn) {
    const V sb = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(sb, mag), _mm256_and_ps(sgn, sb));
  }
  static V select_lt(V a, V b, V x, V y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static bool any_ge(V a, V b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)) != 0; }
  static V maskz(Mask m, V v) { return _mm256_and_ps(v, _mm256_castsi256_ps(m)); }
  static T reduce_add(V v) { return hsum_ps(v); }
  //   lane i of the result = sum of a[i]'s lanes, i < 8: a tree of horizontal adds, then the two
  //   128-bit halves folded (9 instructions for 8 reductions, where hsum_ps takes 6 each)
  PYATTN_ALWAYS_INLINE static V sum_lanes(const V* a) {
    const V t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const V t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const V u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 | a0..a3] halves, a4..a7
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  static V exp2(V v) { return exp2_ps(v); }
  // Half-precision rows: float16 by vcvtph2ps (F16C), bfloat16 by widening to the high half.
  static V load_f16(const f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V bf16_bits(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  static V load_bf16(const bf16_t* p) { return bf16_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  //   the n <= 16 bytes at p in the low bytes of a vector, zeros above, no byte past p + n read.
  //   AVX2 masks only 32-bit lanes: whole ones by vpmaskmovd, the last 1-3 bytes one by one (a
  //   memcpy into a zeroed buffer was a library call per row, the accumulators spilled around it).
  static __m128i load_bytes_n(const void* p, int n) {
    const int w = n / 4, t = n % 4;
    const __m128i lane = _mm_setr_epi32(0, 1, 2, 3);
    __m128i v = _mm_maskload_epi32(static_cast<const int*>(p), _mm_cmpgt_epi32(_mm_set1_epi32(w), lane));
    if (t) {
      const unsigned char* b = static_cast<const unsigned char*>(p) + 4 * w;
      std::uint32_t x = b[0];
      if (t > 1) x |= std::uint32_t(b[1]) << 8;
      if (t > 2) x |= std::uint32_t(b[2]) << 16;
      v = _mm_or_si128(v, _mm_and_si128(_mm_set1_epi32(int(x)), _mm_cmpeq_epi32(_mm_set1_epi32(w), lane)));
    }
    return v;
  }
  template <class H>
  static __m128i load_half_n(int n, const H* p) {
    return load_bytes_n(p, 2 * (n < 8 ? n : 8));
  }
  static V load_f16_n(Mask, int n, const f16_t* p) { return _mm256_cvtph_ps(load_half_n(n, p)); }
  // int8 rows (a quantised cache; the caller applies the row's scale).
  static V load_i8(const std::int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V load_i8_n(Mask, int n, const std::int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes_n(p, n < 8 ? n : 8)));
  }
  static V load_bf16_n(Mask, int n, const bf16_t* p) { return bf16_bits(load_half_n(n, p)); }
};
struct OpsF64 {
  using T = double;
  using V = __m256d;
  using Mask = __m256i;
  static constexpr int L = 4;
  static constexpr int kRegs = 16;
  static Mask mask(int n) { return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3)); }
  static V load(const T* p) { return _mm256_loadu_pd(p); }
  static V maskload(Mask m, const T* p) { return _mm256_maskload_pd(p, m); }
  static void store(T* p, V v) { _mm256_storeu_pd(p, v); }
  static void maskstore(Mask m, T* p, V v) { _mm256_maskstore_pd(p, m, v); }
  static V set1(T v) { return _mm256_set1_pd(v); }
  static V zero() { return _mm256_setzero_pd(); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V sub(V a, V b) { return _mm256_sub_pd(a, b); }
  static V max(V a, V b) { return _mm256_max_pd(a, b); }
  static T reduce_max(V v) {
    const __m128d x = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_max_sd(x, _mm_unpackhi_pd(x, x)));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V div(V a, V b) { return _mm256_div_pd(a, b); }
  static V abs(V a) { return _mm256_andnot_pd(_mm256_set1_pd(-0.0), a); }
  static V copysign(V mag, V sgn) {
    const V sb = _mm256_set1_pd(-0.0);
    return _mm256_or_pd(_mm256_andnot_pd(sb, mag), _mm256_and_pd(sgn, sb));
  }
  static V select_lt(V a, V b, V x, V y) { return _mm256_blendv_pd(y, x, _mm256_cmp_pd(a, b, _CMP_LT_OQ)); }
  static bool any_ge(V a, V b) { return _mm256_movemask_pd(_mm256_cmp_pd(a, b, _CMP_GE_OQ)) != 0; }
  static V maskz(Mask m, V v) { return _mm256_and_pd(v, _mm256_castsi256_pd(m)); }
  static T reduce_add(V v) { return hsum_pd(v); }
  static V exp2(V v) { return exp2_pd(v); }
};

#include "kernels/x86_simd.h"

// Register tiles: 6 rows of A broadcast x 2 vectors of B = 12 accumulators + 2 B vectors + 1
// broadcast, 15 of the 16 ymm registers.
// Block sizes: a 6 x KC A micro-panel (6 KiB) in L1, a KC x NC packed B block (512 KiB) in L2;
// attention key blocks of BK = 256 keys, BKN = 128 where E and Ev are under 128 (Intel Xeon,
// tools/ab_cores.py, 2 threads, BKN 128 over 256: D64 1.03-1.07x faster, plain, causal, cross and
// 5-D; E64 Ev128 0.98 and D128 0.97, which keep 256; on Zen 4 128 and 256 measured alike);
// NP = 4 panels of 16 queries per attention task share each K/V row read; NPW = 8 for heads of
// 128 and more (A/B, 2 threads: 8 panels took 0.91-0.93 of the time at L4096 D128, and at D64
// 1.00 plain, 1.02 causal, where longer query groups cross more diagonal blocks).
struct sgemm_ukernel_6x16_avx2 : RegTileKernels<OpsF32, 6, 2>, TransposePs {
  static constexpr int NP = 4, NPW = 8;
  static constexpr index_t MC = 120, KC = 256, NC = 512, BK = 256, BKN = 128;
  // Scores a panel at a time, each 16-query panel's Q^T (4-8 KiB) kept in L1 while the block's K
  // rows come from L2 (Zen 4, 2 threads, tools/ab_cores.py against keys outer, six runs: L4096
  // D128 1.01-1.04x faster, L2048 D64 1.00-1.09x (the most while other work shared the machine),
  // causal and short calls 0.97-1.05x, the A/A noise being 0.98-1.01). AVX-512's 48-query panels
  // read 0.98-1.01 this way and keep keys outer. With this order 8 panels were 1.04x faster at
  // L2048 D64 but 0.92-0.98x on short causal calls, so NP stays 4.
  static constexpr bool kPanelOuterScores = true;
  // Single decode rows of 512 bytes and more (D128 float32) streamed from memory take the
  // key-by-key loop with prefetches on every CPU, Intel's included (decode_prefetch_streams says
  // no there): with 32-byte vectors the loop of L keys at a time issues two loads a cache line,
  // and the out-of-order window reaches half as many lines ahead as AVX-512's. Intel Xeon, 2
  // threads, caches evicted between calls, three alternating processes: B1 H32 Lk4096-32768 and
  // B4 H32 Lk2048 D128 1.06-1.09x faster; AVX-512 the other way (0.92x), D64 rows either way.
  static constexpr index_t kStreamKeysRowBytes = 512;
};
struct dgemm_ukernel_6x8_avx2 : RegTileKernels<OpsF64, 6, 2>, TransposeRef<double> {
  static constexpr int NP = 4, NPW = 4;
  static constexpr index_t MC = 120, KC = 256, NC = 256, BK = 128;
};

#include "frame/instantiate.h"

}  // namespace avx2

const IsaTable isa_avx2 = avx2::make_table<avx2::sgemm_ukernel_6x16_avx2, avx2::dgemm_ukernel_6x8_avx2>("avx2");

}  // namespace pyattn
