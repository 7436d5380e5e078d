// Fused, numerically stable row softmax, instantiated per ISA.
//   y = x * scale + mask;  m = max(y);  out = exp2((y - m) log2(e)) / sum(exp2((y - m) log2(e)))
// log2(e) is applied after the maximum is taken: y - m <= 0 cannot overflow, where y log2(e)
// would for |y| past max / log2(e) (a row of -3e38 came out as zeros, [3e38, 0, -3e38] as NaN).
#pragma once

template <class K>
struct Softmax {
  using T = typename K::T;

  // y = x * scale, masked; returns max(y) (-inf when every entry is masked).
  static T load_scaled(const SoftmaxArgs& s, index_t r, T* y) {
    const T* x = static_cast<const T*>(s.x) + s.xoff[r];
    const T sc = T(s.scale);
    const index_t n = s.n, xcs = s.xcs;
    for (index_t j = 0; j < n; ++j) y[j] = x[j * xcs] * sc;
    apply_mask_row(s.mask_kind, s.mask, s.mask_kind == MaskKind::none ? 0 : s.moff[r], s.mcs, n, y, 1, T(1));
    T mx = -NumLimits<T>::inf;
#if !PYATTN_MSVC  // MSVC's OpenMP has no max reduction (an OpenMP 3.1 operator)
#pragma omp simd reduction(max : mx)
#endif
    for (index_t j = 0; j < n; ++j) mx = y[j] > mx ? y[j] : mx;
    return mx;
  }

  // out = softmax of row r. Rows written with unit stride are computed in place in out; a
  // strided output row goes through buf (n elements), the only case that needs it.
  static void row(const SoftmaxArgs& s, index_t r, T* buf) {
    T* o = static_cast<T*>(s.out) + s.ooff[r];
    const index_t n = s.n;
    T* y = s.ocs == 1 ? o : buf;
    const T mx = load_scaled(s, r, y);
    if (mx == -NumLimits<T>::inf) {  // no finite score: fully masked (zeros) or all NaN (NaN)
      const T fill = has_nan(y, n) ? std::numeric_limits<T>::quiet_NaN() : T(0);
      for (index_t j = 0; j < n; ++j) o[j * s.ocs] = fill;
      return;
    }
    const T inv = T(1) / K::exp2_scaled_sum(y, n, mx, T(kLog2e));
    if (y == o) {
#pragma omp simd
      for (index_t j = 0; j < n; ++j) o[j] *= inv;
    } else {
      for (index_t j = 0; j < n; ++j) o[j * s.ocs] = y[j] * inv;
    }
  }

  static bool has_nan(const T* y, index_t n) {
    for (index_t j = 0; j < n; ++j)
      if (y[j] != y[j]) return true;
    return false;
  }

  static void run(const SoftmaxArgs& s) {
    if (s.rows == 0 || s.n == 0) return;
    const int nt = threads_for(double(s.rows) * double(s.n) * 8.0, s.nthreads);
    const std::size_t bytes = s.ocs == 1 ? 0 : std::size_t(s.n) * sizeof(T);
    team(
        nt, [&] { return bytes ? static_cast<T*>(scratch(0, bytes)) : nullptr; },
        [&](T* buf, const Team& tm) { tm.for_each(s.rows, false, [&](index_t r) { row(s, r, buf); }); });
  }
};
