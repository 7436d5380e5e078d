// Shared helpers of the portable frame. Included by every ISA translation unit *inside* its
// own namespace (pyattn::PYATTN_ISA_NS) so that no inline symbol compiled with one ISA's
// flags can be picked by the linker for another ISA's code.
#pragma once

template <class T>
struct NumLimits;
template <>
struct NumLimits<float> {
  static constexpr float inf = __builtin_huge_valf();
};
template <>
struct NumLimits<double> {
  static constexpr double inf = __builtin_huge_val();
};

inline index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }
inline index_t round_up(index_t a, index_t b) { return ceil_div(a, b) * b; }
template <class T>
inline T min_of(T a, T b) { return a < b ? a : b; }
template <class T>
inline T max_of(T a, T b) { return a < b ? b : a; }

// [begin, end) of `total` items for thread `tid` of `nt`, in contiguous chunks.
inline void split_range(index_t total, int tid, int nt, index_t& begin, index_t& end) {
  index_t q = total / nt, r = total % nt;
  begin = tid * q + min_of<index_t>(tid, r);
  end = begin + q + (tid < r ? 1 : 0);
}

// Threads worth waking for `work` multiply-adds: a parallel region costs a few microseconds,
// about what one core spends on ~100k multiply-adds.
inline int threads_for(double work, int nthreads) {
  if (nthreads <= 1 || work < 1.5e5) return 1;
  int by_work = static_cast<int>(work / 1.0e5);
  return max_of(1, min_of(nthreads, by_work));
}

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

// dst[p*MR + r] = a[r*rsa + p] for a full panel of MR rows with unit column stride.
template <class T, int MR>
inline void pack_a_rows_ref(const T* a, index_t rsa, index_t kc, T* dst) {
  for (int r = 0; r < MR; ++r) {
    const T* ar = a + r * rsa;
    for (index_t p = 0; p < kc; ++p) dst[p * MR + r] = ar[p];
  }
}

//   dst[c*drs + r] = src[r*srs + c], r < rows, c < cols
template <class T>
inline void transpose_ref(const T* src, index_t srs, index_t rows, index_t cols, T* dst, index_t drs) {
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) dst[c * drs + r] = src[r * srs + c];
}
