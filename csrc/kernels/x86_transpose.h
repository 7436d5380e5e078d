// 8x8 float transposes with AVX (unpack, shuffle, 128-bit permute), shared by the AVX2 and
// AVX-512 translation units (included inside each one's namespace).
#pragma once

//   dst[c*drs + r] = src[r*srs + c] for an 8 x 8 block
static inline void transpose8x8_ps(const float* src, index_t srs, float* dst, index_t drs) {
  __m256 r[8], t[8], u[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * srs);
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * drs, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * drs, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}

//   dst[c*drs + r] = src[r*srs + c], r < rows, c < cols: 8 x 8 blocks in registers, edges scalar
static inline void transpose_ps(const float* src, index_t srs, index_t rows, index_t cols, float* dst, index_t drs) {
  index_t r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8) {
    index_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) transpose8x8_ps(src + r0 * srs + c0, srs, dst + c0 * drs + r0, drs);
    for (; c0 < cols; ++c0)
      for (index_t r = r0; r < r0 + 8; ++r) dst[c0 * drs + r] = src[r * srs + c0];
  }
  for (; r0 < rows; ++r0)
    for (index_t c = 0; c < cols; ++c) dst[c * drs + r0] = src[r0 * srs + c];
}
