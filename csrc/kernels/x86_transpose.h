// 8x8 float transposes with AVX, shared by the AVX2 and AVX-512 translation units (included
// inside each one's namespace), with an optional scale per source column (common.h, NoScale).
#pragma once

// The scale of source columns c0..c0+3 in both 128-bit lanes (the layout transpose8x8_ps loads).
static inline __m256 col_scale4(const UniformScale<float>& sc, index_t) { return _mm256_set1_ps(sc.s); }
static inline __m256 col_scale4(const ColumnScale<float>& sc, index_t c0) {
  const __m128 v = _mm_loadu_ps(sc.s + c0);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(v), v, 1);
}

//   dst[c*drs + r] = src[r*srs + c] * scale(c) for an 8 x 8 block
// Rows i and i+4 are loaded side by side (columns 0-3 in x[i], 4-7 in x[i+4], row i in the low
// 128-bit lane), so that each lane holds a 4 x 4 block and every shuffle after the loads stays
// within a lane: no lane-crossing permute, which runs on one port only on Intel cores (it took a
// sixth of a 32-token prefill there).
template <class Scale = NoScale>
static inline void transpose8x8_ps(const float* src, index_t srs, float* dst, index_t drs, const Scale& sc = Scale{},
                                   index_t c0 = 0) {
  __m256 x[8], t[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const float *lo = src + i * srs, *hi = src + (i + 4) * srs;
    x[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(hi), 1);
    x[i + 4] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo + 4)), _mm_loadu_ps(hi + 4), 1);
  }
  if constexpr (!std::is_same<Scale, NoScale>::value) {
    const __m256 s0 = col_scale4(sc, c0), s1 = col_scale4(sc, c0 + 4);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      x[i] = _mm256_mul_ps(x[i], s0);
      x[i + 4] = _mm256_mul_ps(x[i + 4], s1);
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < 8; h += 4) {  // h = 0: columns 0-3, h = 4: columns 4-7
    t[h] = _mm256_unpacklo_ps(x[h], x[h + 1]);
    t[h + 1] = _mm256_unpackhi_ps(x[h], x[h + 1]);
    t[h + 2] = _mm256_unpacklo_ps(x[h + 2], x[h + 3]);
    t[h + 3] = _mm256_unpackhi_ps(x[h + 2], x[h + 3]);
    _mm256_storeu_ps(dst + (h + 0) * drs, _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_storeu_ps(dst + (h + 1) * drs, _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2)));
    _mm256_storeu_ps(dst + (h + 2) * drs, _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_storeu_ps(dst + (h + 3) * drs, _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2)));
  }
}

//   dst[c*drs + r] = src[r*srs + c] * scale(c), r < rows, c < cols: 8 x 8 blocks in registers,
//   edges scalar
template <class Scale = NoScale>
static inline void transpose_ps(const float* src, index_t srs, index_t rows, index_t cols, float* dst, index_t drs,
                                const Scale& sc = Scale{}) {
  index_t r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8) {
    index_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) transpose8x8_ps(src + r0 * srs + c0, srs, dst + c0 * drs + r0, drs, sc, c0);
    for (; c0 < cols; ++c0)
      for (index_t r = r0; r < r0 + 8; ++r) dst[c0 * drs + r] = scaled(src[r * srs + c0], sc, c0);
  }
  for (; r0 < rows; ++r0)
    for (index_t c = 0; c < cols; ++c) dst[c * drs + r0] = scaled(src[r0 * srs + c], sc, c);
}

#include "kernels/transpose_traits.h"
