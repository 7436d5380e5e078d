// The NEON vectors (Ops for float and double), exp2, the register tile's k loop and the 4 x 4
// transposes: everything of the AArch64 kernel set but its block sizes. Included inside
// namespace pyattn::neon by kernels_neon.cpp (and by tools/mca_neon.sh's throughput probe),
// after frame/common.h; kernels/x86_simd.h, included after it, builds the kernels on these Ops.
#pragma once

// exp2 for x <= 128 (float) / 1024 (double): x = n + f, |f| <= 1/2, 2^f by the Taylor polynomial
// in f*ln2 the x86 sets use (degree 7 / 13, truncation below 0.1 ulp), 2^n built in the exponent
// field. x below -126 (-1022) gives 0, never a subnormal (common.h, kExp2Floor); fmax/fmin keep
// NaN.
static inline float32x4_t exp2_ps(float32x4_t x) {
  const uint32x4_t under = vcltq_f32(x, vdupq_n_f32(float(kExp2Floor<float>)));  // false for NaN
  x = vmaxq_f32(x, vdupq_n_f32(float(kExp2Floor<float>)));
  x = vminq_f32(x, vdupq_n_f32(128.0f));
  const float32x4_t n = vrndnq_f32(x);
  const float32x4_t f = vsubq_f32(x, n);
  float32x4_t p = vdupq_n_f32(float(kExp2Taylor[7]));
#pragma GCC unroll 7
  for (int i = 6; i >= 0; --i) p = vfmaq_f32(vdupq_n_f32(float(kExp2Taylor[i])), p, f);
  // n = 128 gives +inf.
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(p, vreinterpretq_f32_s32(e))), under));
}

static inline float64x2_t exp2_pd(float64x2_t x) {
  const uint64x2_t under = vcltq_f64(x, vdupq_n_f64(double(kExp2Floor<double>)));
  x = vmaxq_f64(x, vdupq_n_f64(double(kExp2Floor<double>)));
  x = vminq_f64(x, vdupq_n_f64(1024.0));
  const float64x2_t n = vrndnq_f64(x);
  const float64x2_t f = vsubq_f64(x, n);
  float64x2_t p = vdupq_n_f64(kExp2Taylor[13]);
#pragma GCC unroll 13
  for (int i = 12; i >= 0; --i) p = vfmaq_f64(vdupq_n_f64(kExp2Taylor[i]), p, f);
  const int64x2_t e = vshlq_n_s64(vaddq_s64(vcvtq_s64_f64(n), vdupq_n_s64(1023)), 52);
  return vreinterpretq_f64_u64(vbicq_u64(vreinterpretq_u64_f64(vmulq_f64(p, vreinterpretq_f64_s64(e))), under));
}

// ------------------------------------------------------------------ the register tile's k loop
// acc[M][NV] += A[M x k] B[k x NV*L] for kernels/x86_simd.h's gemm_regtile, which sets the
// accumulators and hands them to the epilogue. AArch64 multiplies a vector by one lane of another
// (fmla by element), so A is loaded as whole vectors and never broadcast:
//  - a column of A contiguous (rsa = 1: the GEMM's packed A panels, and V^T in attention's P V
//    step): each k step loads its M values as M/L vectors and B's NV vectors, then M*NV fmla, one
//    lane of A each: for 8 x 12, 5 loads per 24 FMAs;
//  - a row of A contiguous (csa = 1: the K rows the attention scores read in place): one vector
//    per row covers L k steps, lane p of it multiplying the B row of step p. The rows go four at a
//    time (two sets of 12 accumulators + 4 A + 3 B = 31 of the 32 registers), B read from L1
//    once per group: 8 A and 24 B loads per 96 FMAs;
//  - anything else (a strided A, the last k % L steps) loads A one value at a time, which the
//    compiler folds into fmla by element [0].
template <class Ops, int NV, int M, int R>
static inline __attribute__((always_inline)) void col_row(typename Ops::V (&acc)[M][NV], const typename Ops::V* bv,
                                                          const typename Ops::V* av) {
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) acc[R][v] = Ops::template fma_lane<R % Ops::L>(acc[R][v], bv[v], av[R / Ops::L]);
}
template <class Ops, int NV, int M, int... R>
static inline __attribute__((always_inline)) void col_step(typename Ops::V (&acc)[M][NV], const typename Ops::V* bv,
                                                           const typename Ops::V* av,
                                                           std::integer_sequence<int, R...>) {
  (col_row<Ops, NV, M, R>(acc, bv, av), ...);
}

// Lane I of the G rows of A in ar times the B row of k step I, into accumulator set I % 2.
template <class Ops, int NV, int G, int I>
static inline __attribute__((always_inline)) void row_lane(typename Ops::V (&s)[2][G][NV], const typename Ops::V* ar,
                                                           const typename Ops::T* bp) {
  typename Ops::V bv[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) bv[v] = Ops::load(bp + v * Ops::L);
#pragma GCC unroll 4
  for (int r = 0; r < G; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) s[I % 2][r][v] = Ops::template fma_lane<I>(s[I % 2][r][v], bv[v], ar[r]);
}
template <class Ops, int NV, int G, int... I>
static inline __attribute__((always_inline)) void row_step(typename Ops::V (&s)[2][G][NV], const typename Ops::T* a,
                                                           index_t rsa, const typename Ops::T* b, index_t ldb,
                                                           std::integer_sequence<int, I...>) {
  typename Ops::V ar[G];
#pragma GCC unroll 4
  for (int r = 0; r < G; ++r) ar[r] = Ops::load(a + r * rsa);
  (row_lane<Ops, NV, G, I>(s, ar, b + I * ldb), ...);
}

// Rows R0..R0+G-1 of the tile over k steps [0, kl), kl a multiple of L. Even and odd k steps go
// to two sets of accumulators, added at the end: each of the 12 accumulators of a group would
// otherwise take L dependent FMAs per step, a chain of L x 4 cycles that holds a core with four
// FMA pipes (Neoverse V1) to 3/4 of its rate; two sets make 24 chains of L/2.
template <class Ops, int NV, int M, int R0, int G>
static inline __attribute__((always_inline)) void row_pass(typename Ops::V (&acc)[M][NV], index_t kl,
                                                           const typename Ops::T* a, index_t rsa,
                                                           const typename Ops::T* b, index_t ldb) {
  typename Ops::V s[2][G][NV];
#pragma GCC unroll 4
  for (int r = 0; r < G; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) s[0][r][v] = acc[R0 + r][v], s[1][r][v] = Ops::zero();
  for (index_t p = 0; p < kl; p += Ops::L)
    row_step<Ops, NV, G>(s, a + R0 * rsa + p, rsa, b + p * ldb, ldb, std::make_integer_sequence<int, Ops::L>{});
#pragma GCC unroll 4
  for (int r = 0; r < G; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[R0 + r][v] = Ops::add(s[0][r][v], s[1][r][v]);
}

template <class Ops, int NV, int M>
static inline __attribute__((always_inline)) void regtile_kloop(typename Ops::V (&acc)[M][NV], index_t k,
                                                                const typename Ops::T* a, index_t rsa, index_t csa,
                                                                const typename Ops::T* b, index_t ldb) {
  using V = typename Ops::V;
  constexpr int L = Ops::L;
  static_assert(M <= 8, "two groups of four rows at most");
  if constexpr (M % L == 0) {
    if (rsa == 1) {
      for (index_t p = 0; p < k; ++p) {
        V bv[NV], av[M / L];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) bv[v] = Ops::load(b + v * L);
#pragma GCC unroll 4
        for (int i = 0; i < M / L; ++i) av[i] = Ops::load(a + i * L);
        col_step<Ops, NV, M>(acc, bv, av, std::make_integer_sequence<int, M>{});
        a += csa;
        b += ldb;
      }
      return;
    }
  }
  index_t p = 0;
  if (csa == 1) {
    // One pass over k per group of rows: in a single loop over both groups the compiler hoisted
    // all eight rows' loads together and spilled accumulators.
    p = k - k % L;
    row_pass<Ops, NV, M, 0, (M < 4 ? M : 4)>(acc, p, a, rsa, b, ldb);
    if constexpr (M > 4) row_pass<Ops, NV, M, 4, M - 4>(acc, p, a, rsa, b, ldb);
  }
  for (; p < k; ++p) {
    const typename Ops::T* bp = b + p * ldb;
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = Ops::load(bp + v * L);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const V ar = Ops::set1(a[r * rsa + p * csa]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = Ops::fma(ar, bv[v], acc[r][v]);
    }
  }
}

// NEON has no masked loads or stores: a mask is the count of leading lanes, and a partial vector
// goes through a zeroed copy of L lanes (only the edges of rows and tiles take this path).
struct Lanes {
  int n;
};
template <class V, class T, int L, class Load>
static inline V load_first(Lanes m, const T* p, Load&& load) {
  alignas(16) T buf[L] = {};
  __builtin_memcpy(buf, p, std::size_t(m.n) * sizeof(T));
  return load(buf);
}

struct OpsF32 {
  using T = float;
  using V = float32x4_t;
  using Mask = Lanes;
  static constexpr int L = 4;
  static Mask mask(int n) { return Lanes{n <= 0 ? 0 : n >= L ? L : n}; }
  static V load(const T* p) { return vld1q_f32(p); }
  static V maskload(Mask m, const T* p) {
    return m.n == L ? load(p) : load_first<V, T, L>(m, p, [](const T* q) { return vld1q_f32(q); });
  }
  static void store(T* p, V v) { vst1q_f32(p, v); }
  static void maskstore(Mask m, T* p, V v) {
    if (m.n == L) return store(p, v);
    alignas(16) T buf[L];
    vst1q_f32(buf, v);
    __builtin_memcpy(p, buf, std::size_t(m.n) * sizeof(T));
  }
  static V set1(T v) { return vdupq_n_f32(v); }
  static V zero() { return vdupq_n_f32(0.0f); }
  static V add(V a, V b) { return vaddq_f32(a, b); }
  static V sub(V a, V b) { return vsubq_f32(a, b); }
  // fmax returns NaN when either operand is NaN; the kernels only compare these maxima with >,
  // for which a NaN is no larger than anything, as with the x86 max.
  static V max(V a, V b) { return vmaxq_f32(a, b); }
  static T reduce_max(V v) { return vmaxvq_f32(v); }
  static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V div(V a, V b) { return vdivq_f32(a, b); }
  static V abs(V a) { return vabsq_f32(a); }
  static V copysign(V mag, V sgn) {  // |mag| with sgn's sign bit
    return vbslq_f32(vdupq_n_u32(0x80000000u), sgn, vabsq_f32(mag));
  }
  static V select_lt(V a, V b, V x, V y) { return vbslq_f32(vcltq_f32(a, b), x, y); }
  static bool any_ge(V a, V b) { return vmaxvq_u32(vcgeq_f32(a, b)) != 0; }
  static V maskz(Mask m, V v) {
    static constexpr std::uint32_t iota[4] = {0, 1, 2, 3};
    const uint32x4_t keep = vcltq_u32(vld1q_u32(iota), vdupq_n_u32(std::uint32_t(m.n)));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(v), keep));
  }
  //   (v0 + v1) + (v2 + v3), sum_lanes's order, spelled out (vaddvq leaves it to the compiler)
  static T reduce_add(V v) {
    const V t = vpaddq_f32(v, v);
    return vgetq_lane_f32(vpaddq_f32(t, t), 0);
  }
  //   lane i of the result = sum of a[i]'s lanes, i < 4: two rounds of pairwise adds
  static V sum_lanes(const V* a) { return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3])); }
  static V exp2(V v) { return exp2_ps(v); }
  // Half-precision rows: float16 by fcvtl (vcvt_f32_f16, base AArch64), bfloat16 by widening
  // each 16-bit value into the high half of its lane.
  static const std::uint16_t* bits(const f16_t* p) { return reinterpret_cast<const std::uint16_t*>(p); }
  static const std::uint16_t* bits(const bf16_t* p) { return reinterpret_cast<const std::uint16_t*>(p); }
  static V from_f16(uint16x4_t h) { return vcvt_f32_f16(vreinterpret_f16_u16(h)); }
  static V from_bf16(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }
  static uint16x4_t load_u16_n(int n, const std::uint16_t* p) {
    alignas(8) std::uint16_t buf[L] = {};
    __builtin_memcpy(buf, p, std::size_t(n < L ? n : L) * 2);
    return vld1_u16(buf);
  }
  static V load_f16(const f16_t* p) { return from_f16(vld1_u16(bits(p))); }
  static V load_f16_n(Mask, int n, const f16_t* p) { return from_f16(load_u16_n(n, bits(p))); }
  static V load_bf16(const bf16_t* p) { return from_bf16(vld1_u16(bits(p))); }
  static V load_bf16_n(Mask, int n, const bf16_t* p) { return from_bf16(load_u16_n(n, bits(p))); }
  // int8 rows (a quantised cache; the caller applies the row's scale): four bytes widened twice.
  static V from_i8(std::int32_t w) {
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
  }
  static V load_i8(const std::int8_t* p) {
    std::int32_t w;
    __builtin_memcpy(&w, p, 4);
    return from_i8(w);
  }
  static V load_i8_n(Mask, int n, const std::int8_t* p) {
    std::int32_t w = 0;
    __builtin_memcpy(&w, p, std::size_t(n < L ? n : L));
    return from_i8(w);
  }
  // acc += b * a[lane]: the multiply-by-element form the register tile is built on.
  template <int I>
  static V fma_lane(V acc, V b, V a) {
    return vfmaq_laneq_f32(acc, b, a, I);
  }
  template <int NV, int M>
  static inline __attribute__((always_inline)) void kloop(V (&acc)[M][NV], index_t k, const T* a, index_t rsa,
                                                          index_t csa, const T* b, index_t ldb) {
    regtile_kloop<OpsF32, NV, M>(acc, k, a, rsa, csa, b, ldb);
  }
};

struct OpsF64 {
  using T = double;
  using V = float64x2_t;
  using Mask = Lanes;
  static constexpr int L = 2;
  static Mask mask(int n) { return Lanes{n <= 0 ? 0 : n >= L ? L : n}; }
  static V load(const T* p) { return vld1q_f64(p); }
  static V maskload(Mask m, const T* p) {
    return m.n == L ? load(p) : load_first<V, T, L>(m, p, [](const T* q) { return vld1q_f64(q); });
  }
  static void store(T* p, V v) { vst1q_f64(p, v); }
  static void maskstore(Mask m, T* p, V v) {
    if (m.n == L) return store(p, v);
    if (m.n == 1) vst1q_lane_f64(p, v, 0);
  }
  static V set1(T v) { return vdupq_n_f64(v); }
  static V zero() { return vdupq_n_f64(0.0); }
  static V add(V a, V b) { return vaddq_f64(a, b); }
  static V sub(V a, V b) { return vsubq_f64(a, b); }
  static V max(V a, V b) { return vmaxq_f64(a, b); }
  static T reduce_max(V v) { return vmaxvq_f64(v); }
  static V fma(V a, V b, V c) { return vfmaq_f64(c, a, b); }
  static V mul(V a, V b) { return vmulq_f64(a, b); }
  static V div(V a, V b) { return vdivq_f64(a, b); }
  static V abs(V a) { return vabsq_f64(a); }
  static V copysign(V mag, V sgn) { return vbslq_f64(vdupq_n_u64(0x8000000000000000ull), sgn, vabsq_f64(mag)); }
  static V select_lt(V a, V b, V x, V y) { return vbslq_f64(vcltq_f64(a, b), x, y); }
  static bool any_ge(V a, V b) { return vmaxvq_u32(vreinterpretq_u32_u64(vcgeq_f64(a, b))) != 0; }
  static V maskz(Mask m, V v) { return m.n >= L ? v : m.n == 1 ? vsetq_lane_f64(0.0, v, 1) : vdupq_n_f64(0.0); }
  static T reduce_add(V v) { return vgetq_lane_f64(vpaddq_f64(v, v), 0); }  // (sum_lanes's order)
  static V sum_lanes(const V* a) { return vpaddq_f64(a[0], a[1]); }
  static V exp2(V v) { return exp2_pd(v); }
  template <int I>
  static V fma_lane(V acc, V b, V a) {
    return vfmaq_laneq_f64(acc, b, a, I);
  }
  template <int NV, int M>
  static inline __attribute__((always_inline)) void kloop(V (&acc)[M][NV], index_t k, const T* a, index_t rsa,
                                                          index_t csa, const T* b, index_t ldb) {
    regtile_kloop<OpsF64, NV, M>(acc, k, a, rsa, csa, b, ldb);
  }
};

// 4 x 4 float transposes: trn1/trn2 on 32-bit lanes, then on 64-bit halves; an optional scale per
// source column (common.h, NoScale) applied to the rows as they are loaded.
static inline float32x4_t col_scale4(const UniformScale<float>& sc, index_t) { return vdupq_n_f32(sc.s); }
static inline float32x4_t col_scale4(const ColumnScale<float>& sc, index_t c0) { return vld1q_f32(sc.s + c0); }

//   dst[c*drs + r] = src[r*srs + c] * scale(c) for a 4 x 4 block
template <class Scale = NoScale>
static inline void transpose4x4_ps(const float* src, index_t srs, float* dst, index_t drs, const Scale& sc = Scale{},
                                   index_t c0 = 0) {
  float32x4_t r0 = vld1q_f32(src), r1 = vld1q_f32(src + srs), r2 = vld1q_f32(src + 2 * srs),
              r3 = vld1q_f32(src + 3 * srs);
  if constexpr (!std::is_same<Scale, NoScale>::value) {
    const float32x4_t s = col_scale4(sc, c0);
    r0 = vmulq_f32(r0, s);
    r1 = vmulq_f32(r1, s);
    r2 = vmulq_f32(r2, s);
    r3 = vmulq_f32(r3, s);
  }
  const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(r0, r1)), t1 = vreinterpretq_f64_f32(vtrn2q_f32(r0, r1)),
                    t2 = vreinterpretq_f64_f32(vtrn1q_f32(r2, r3)), t3 = vreinterpretq_f64_f32(vtrn2q_f32(r2, r3));
  vst1q_f32(dst, vreinterpretq_f32_f64(vtrn1q_f64(t0, t2)));
  vst1q_f32(dst + drs, vreinterpretq_f32_f64(vtrn1q_f64(t1, t3)));
  vst1q_f32(dst + 2 * drs, vreinterpretq_f32_f64(vtrn2q_f64(t0, t2)));
  vst1q_f32(dst + 3 * drs, vreinterpretq_f32_f64(vtrn2q_f64(t1, t3)));
}

//   dst[c*drs + r] = src[r*srs + c] * scale(c), r < rows, c < cols: 4 x 4 blocks in registers,
//   edges scalar
template <class Scale = NoScale>
static inline void transpose_ps(const float* src, index_t srs, index_t rows, index_t cols, float* dst, index_t drs,
                                const Scale& sc = Scale{}) {
  index_t r0 = 0;
  for (; r0 + 4 <= rows; r0 += 4) {
    index_t c0 = 0;
    for (; c0 + 4 <= cols; c0 += 4) transpose4x4_ps(src + r0 * srs + c0, srs, dst + c0 * drs + r0, drs, sc, c0);
    for (; c0 < cols; ++c0)
      for (index_t r = r0; r < r0 + 4; ++r) dst[c0 * drs + r] = scaled(src[r * srs + c0], sc, c0);
  }
  for (; r0 < rows; ++r0)
    for (index_t c = 0; c < cols; ++c) dst[c * drs + r0] = scaled(src[r0 * srs + c], sc, c);
}

#include "kernels/transpose_traits.h"
