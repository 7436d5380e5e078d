// AVX-512 kernels (F/DQ/BW/VL). Compiled with those flags only; chosen at import when the CPU
// has them. The schedules are in kernels/x86_simd.h; this file supplies the vectors.
#include <immintrin.h>

#include "kernels/std_includes.h"

namespace pyattn {
namespace avx512 {

#include "frame/common.h"
#include "kernels/x86_transpose.h"

// exp2 for x <= 128: x = n + f, |f| <= 1/2; 2^f by its degree-7 (float) or degree-13 (double)
// Taylor polynomial in f*ln2 (truncation below 0.1 ulp), then scalef multiplies by 2^n. x below
// -126 (-1022) gives 0, never a subnormal (common.h, kExp2Floor): the lanes kept have x >= -126, so
// scalef never forms one. -inf gives 0; NaN goes through (the unordered compare keeps its lane,
// and max with x second returns it).
static inline __m512 exp2_ps(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(float(kExp2Floor<float>)), _CMP_NLT_UQ);
  x = _mm512_max_ps(_mm512_set1_ps(float(kExp2Floor<float>)), x);
  x = _mm512_min_ps(_mm512_set1_ps(128.0f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(float(kExp2Taylor[7]));
#pragma GCC unroll 7
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(float(kExp2Taylor[i])));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

static inline __m512d exp2_pd(__m512d x) {
  const __mmask8 keep = _mm512_cmp_pd_mask(x, _mm512_set1_pd(double(kExp2Floor<double>)), _CMP_NLT_UQ);
  x = _mm512_max_pd(_mm512_set1_pd(double(kExp2Floor<double>)), x);
  x = _mm512_min_pd(_mm512_set1_pd(1025.0), x);
  const __m512d n = _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512d f = _mm512_sub_pd(x, n);
  __m512d p = _mm512_set1_pd(kExp2Taylor[13]);
#pragma GCC unroll 13
  for (int i = 12; i >= 0; --i) p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(kExp2Taylor[i]));
  return _mm512_maskz_scalef_pd(keep, p, n);
}

// Lanes [0, n) of a vector of L lanes (none for n <= 0).
template <class M, int L>
static inline M lane_mask(int n) {
  return n <= 0 ? M(0) : n >= L ? M(~0u) : M((1u << n) - 1);
}

struct OpsF32 {
  using T = float;
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int L = 16;
  static Mask mask(int n) { return lane_mask<Mask, L>(n); }
  static V load(const T* p) { return _mm512_loadu_ps(p); }
  static V maskload(Mask m, const T* p) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(T* p, V v) { _mm512_storeu_ps(p, v); }
  static void maskstore(Mask m, T* p, V v) { _mm512_mask_storeu_ps(p, m, v); }
  static V set1(T v) { return _mm512_set1_ps(v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static T reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V abs(V a) { return _mm512_abs_ps(a); }
  static V copysign(V mag, V sgn) {  // |mag| with sgn's sign bit
    return _mm512_or_ps(_mm512_abs_ps(mag), _mm512_and_ps(sgn, _mm512_set1_ps(-0.0f)));
  }
  static V select_lt(V a, V b, V x, V y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }
  static bool any_ge(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ) != 0; }
  static V maskz(Mask m, V v) { return _mm512_maskz_mov_ps(m, v); }
  //   the sum of v's lanes in sum_lanes's order (lanes l and l + 2 of each 128-bit lane, then
  //   those pairs, then 128-bit lanes 0 + 1 and 2 + 3, then the two), so that a key's score summed
  //   key by key has the bits of the same score summed L keys at a time
  static T reduce_add(V v) {
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm512_cvtss_f32(v);
  }
  //   lane i of the result = sum of a[i]'s lanes, i < 16: pairs, then quads interleaved within
  //   128-bit lanes, then the four 128-bit lanes folded (45 instructions for 16 reductions, where
  //   reduce_add takes ~8 each). Inlined: out of line, each call spilled its 16 vectors to the
  //   stack and read them back (int8 decode 1.02-1.04x slower, grouped float32 rows 1.02x).
  PYATTN_ALWAYS_INLINE static V sum_lanes(const V* a) {
    V x[8], z[4];
    for (int i = 0; i < 8; ++i)  // x[i] lanes: a[2i], a[2i+1], a[2i], a[2i+1] partial sums
      x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // z[i], each 128-bit lane: a[4i] .. a[4i+3] partial sums
      z[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const V r01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const V r23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(r01, r23, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  static V exp2(V v) { return exp2_ps(v); }
  // Half-precision rows: float16 by vcvtph2ps (F16C), bfloat16 by widening to the high half.
  static V load_f16(const f16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load_f16_n(Mask m, int, const f16_t* p) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
  static V bf16_bits(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static V load_bf16(const bf16_t* p) { return bf16_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load_bf16_n(Mask m, int, const bf16_t* p) { return bf16_bits(_mm256_maskz_loadu_epi16(m, p)); }
  // int8 rows (a quantised cache; the caller applies the row's scale).
  static V load_i8(const std::int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load_i8_n(Mask m, int, const std::int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
  }
};
struct OpsF64 {
  using T = double;
  using V = __m512d;
  using Mask = __mmask8;
  static constexpr int L = 8;
  static Mask mask(int n) { return lane_mask<Mask, L>(n); }
  static V load(const T* p) { return _mm512_loadu_pd(p); }
  static V maskload(Mask m, const T* p) { return _mm512_maskz_loadu_pd(m, p); }
  static void store(T* p, V v) { _mm512_storeu_pd(p, v); }
  static void maskstore(Mask m, T* p, V v) { _mm512_mask_storeu_pd(p, m, v); }
  static V set1(T v) { return _mm512_set1_pd(v); }
  static V zero() { return _mm512_setzero_pd(); }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V sub(V a, V b) { return _mm512_sub_pd(a, b); }
  static V max(V a, V b) { return _mm512_max_pd(a, b); }
  static T reduce_max(V v) { return _mm512_reduce_max_pd(v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
  static V div(V a, V b) { return _mm512_div_pd(a, b); }
  static V abs(V a) { return _mm512_abs_pd(a); }
  static V copysign(V mag, V sgn) { return _mm512_or_pd(_mm512_abs_pd(mag), _mm512_and_pd(sgn, _mm512_set1_pd(-0.0))); }
  static V select_lt(V a, V b, V x, V y) { return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(a, b, _CMP_LT_OQ), y, x); }
  static bool any_ge(V a, V b) { return _mm512_cmp_pd_mask(a, b, _CMP_GE_OQ) != 0; }
  static V maskz(Mask m, V v) { return _mm512_maskz_mov_pd(m, v); }
  static T reduce_add(V v) { return _mm512_reduce_add_pd(v); }
  static V exp2(V v) { return exp2_pd(v); }
};

#include "kernels/x86_simd.h"

// Register tiles: 8 rows of A broadcast x 3 vectors of B = 24 accumulators, 3 loads and 8
// broadcasts per 24 FMAs, leaving 5 of the 32 zmm registers for the schedule.
//
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
//  BK: the BK x 48 score tile (24 KiB at 128) stays in L1 between the two attention GEMMs.
// Attention sweep (builds compared in one process with ONNX Runtime, GFLOP/s, median/best):
//                          NP1 BK128  NP2 BK64   NP2 BK128  NP2 BK256  NP3 BK128
//   2 thr L2048 D64 H8      169/171    170/172    172/179    169/182    175/181
//   2 thr L4096 D128 H8     171/175    185/190    183/190    181/188    194/196
//   1 thr L2048 D64 H4       82/92      79/96      83/96      83/93      84/94
//   1 thr L4096 D128 H1      99/103     98/101     92/104     93/104    101/103
//   1 thr B2 H12 L128        56/72      57/73      60/70      59/74      52/75
// Flat within the noise on one core; on two, panels sharing each K/V row matter (NP1 is 5-10%
// behind) while NP3 was +1-3% over NP2 in a second run (L512, L128, causal alike). NP2 BK128
// is kept: half the scratch of NP3 and finer tasks for the causal schedule.
// NPW, the panels for heads of 128 and more: a later A/B (2 threads, interleaved, time against
// NP2) gave NP3 0.90 / NP4 0.89 at L4096 D128 (causal 0.95 / 0.94) but 1.03 / 1.05 at L2048 D64,
// so only wide heads take more; against NPW 4, NPW 6 / 8 took 0.95 / 0.93 (L4096 D128, causal
// alike), and NPW 8 0.95-1.01 on H32 L1024 causal, L512, B4 L128 and a GQA chunk (D128). 8
// panels of 48 queries: 600 KiB of scratch per thread, within the 1 MiB L2.
// For the prefill of short query sequences (up to kShortLq queries), 8 rows x 2 vectors: a
// 32-query panel carries no padding through the softmax statistics where a 48-query one carries
// 16 columns. A/B against the 8x48 tile alone (Xeon, 2 threads, time 8x32 / 8x48): 32-token
// prefills 0.92-0.94, B8 H12 L128 causal 0.90, plain 0.98, L512 causal 0.97, L1024 D128 causal
// 1.00, L2048 1.04.
struct sgemm_ukernel_8x32_avx512 : RegTileKernels<OpsF32, 8, 2>, TransposePs {
  static constexpr int NP = 2, NPW = 8;
  static constexpr index_t MC = 240, KC = 256, NC = 480, BK = 128;
};
struct sgemm_ukernel_8x48_avx512 : RegTileKernels<OpsF32, 8, 3>, TransposePs {
  static constexpr int NP = 2, NPW = 8;
  static constexpr index_t MC = 240, KC = 256, NC = 480, BK = 128;
  using Short = sgemm_ukernel_8x32_avx512;
  static constexpr index_t kShortLq = 256;
  // Single decode rows over cached-size K/V prefetch the rows ahead among the keys (GPT-2 B1
  // H12 D64 c512-c1024, 2 threads: 0.93-0.99x the time in cache, 1.24-1.29x faster from
  // memory); AVX2 and NEON do not (AVX2: 0.84-0.88x both ways).
  static constexpr bool kPrefetchCachedRows = true;
  // Grouped decode rows streamed from memory take L / 4 keys at a time, as int8 rows do: the
  // key-by-key loop reduces each row's score on its own, and a half row leaves it half the
  // bytes to hide that in (float16 / bfloat16, Hq32 Hkv8 Lk32768 D128, 2 threads: 1.17-1.26x
  // faster; B4 L4096, contiguous and paged: 1.17-1.19x). float32: B4 L4096 paged 1.03-1.04x,
  // contiguous 1.00-1.02x, B1 Lk32768 0.98-1.04x. AVX2 does not (float16 0.87-0.97x, float32
  // paged 0.99x).
  static constexpr bool kGroupedStreamKeys = true;
};
struct dgemm_ukernel_8x24_avx512 : RegTileKernels<OpsF64, 8, 3>, TransposeRef<double> {
  static constexpr int NP = 2, NPW = 2;
  static constexpr index_t MC = 120, KC = 256, NC = 240, BK = 128;
};

#include "frame/instantiate.h"

}  // namespace avx512

const IsaTable isa_avx512 =
    avx512::make_table<avx512::sgemm_ukernel_8x48_avx512, avx512::dgemm_ukernel_8x24_avx512>("avx512");

}  // namespace pyattn
