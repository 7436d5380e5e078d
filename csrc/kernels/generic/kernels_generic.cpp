// Portable kernels: plain C++ the compiler may vectorise for the baseline ISA. They are the
// fallback on any CPU and the reference the SIMD paths are tested against.
#include "kernels/std_includes.h"

namespace pyattn {
namespace generic {

#include "frame/common.h"

// C[mr x nr] (+)= A[mr x k] B[k x NR]; A read through (rsa, csa), B rows NR wide (ldb apart).
template <class T, int MR, int NR>
inline void gemm_ukernel_ref(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                             index_t ldc, int nr, bool accumulate) {
  // mr <= MR and nr <= NR always; clamped so that GCC can see it (else -Warray-bounds on acc).
  // Only nr columns of B are read: B may be the caller's rows in place (the short prefill's V).
  const int m = mr < MR ? mr : MR, n = nr < NR ? nr : NR;
  T acc[MR][NR] = {};
  for (index_t p = 0; p < k; ++p) {
    const T* bp = b + p * ldb;
    for (int r = 0; r < mr; ++r) {
      const T av = a[r * rsa + p * csa];
      for (int j = 0; j < n; ++j) acc[r][j] += av * bp[j];
    }
  }
  for (int r = 0; r < m; ++r)
    for (int j = 0; j < n; ++j) c[r * ldc + j] = accumulate ? c[r * ldc + j] + acc[r][j] : acc[r][j];
}

template <class T>
struct GenericKernels {
  //   x = c - sub (per column); xmax = max(xmax, colmax(x)); c = exp2(x); csum += colsum(c)
  static void exp2_tile(int mr, int nr, T* c, index_t ldc, const T* sub, T* xmax, T* csum) {
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < nr; ++j) {
        const T x = c[r * ldc + j] - sub[j];
        xmax[j] = x > xmax[j] ? x : xmax[j];
        c[r * ldc + j] = exp2_floored(x);
        csum[j] += c[r * ldc + j];
      }
  }
  //   s[i] = mods(s[i]): s = cap * tanh(s) (s arrives divided by the cap), then
  //   s += nslope * |base + step * i|
  template <bool CAP, bool ALIBI>
  static void mod_span(T* s, index_t n, const ScoreMods<T>& md, T base, T step) {
    for (index_t i = 0; i < n; ++i) {
      T x = s[i];
      if (CAP) x = md.cap * std::tanh(x);
      if (ALIBI) x += md.nslope * std::fabs(base + step * T(i));
      s[i] = x;
    }
  }
  //   dst[r*drs + c] = src[r*srs + c], converted to T
  template <class S>
  static void convert_rows(const S* src, index_t srs, index_t rows, index_t cols, T* dst, index_t drs) {
    for (index_t r = 0; r < rows; ++r)
      for (index_t c = 0; c < cols; ++c) dst[r * drs + c] = T(to_float(src[r * srs + c]));
  }
  //   s[x*ss] = q_x . k for x < R
  template <class S>
  static void dot_rows(const T* q, index_t qs, index_t R, const S* k, index_t n, T* s, index_t ss) {
    for (index_t x = 0; x < R; ++x) {
      T d = T(0);
      for (index_t e = 0; e < n; ++e) d += q[x * qs + e] * T(to_float(k[e]));
      s[x * ss] = d;
    }
  }
  //   s[x*ss + j] = q_x . rows[j] for x < R, j < kb (the rows to prefetch, x86_simd.h's, unused)
  template <class S>
  static void dot_keys(const T* q, index_t qs, index_t R, const S* const* rows, index_t kb, index_t n, T* s, index_t ss,
                       const S* const* = nullptr, const S* const* = nullptr, index_t = 0) {
    for (index_t j = 0; j < kb; ++j) dot_rows(q, qs, R, rows[j], n, s + j, ss);
  }
  //   acc[x, d] += sum_j p[x*ps + j] * rows[j][d], the block's sum from zero (as x86_simd.h's
  //   pv_block: not one chain over every key of a long decode)
  template <class S>
  static void pv_rows(const T* p, index_t ps, index_t R, index_t kb, const S* const* rows, index_t Ev, T* acc) {
    constexpr index_t W = 64;  // columns a pass: the block's row sums in a stack row, V read row by row
    T t[W];
    for (index_t x = 0; x < R; ++x)
      for (index_t d0 = 0; d0 < Ev; d0 += W) {
        const index_t w = Ev - d0 < W ? Ev - d0 : W;
        for (index_t d = 0; d < w; ++d) t[d] = T(0);
        for (index_t j = 0; j < kb; ++j) {
          const T pj = p[x * ps + j];
          const S* vr = rows[j] + d0;
          for (index_t d = 0; d < w; ++d) t[d] += pj * T(to_float(vr[d]));
        }
        for (index_t d = 0; d < w; ++d) acc[x * Ev + d0 + d] += t[d];
      }
  }
  //   x[i] = exp2(x[i] - sub[i]); sum[i] += x[i]
  static void exp2_sub_cols(T* x, const T* sub, T* sum, int n) {
    for (int i = 0; i < n; ++i) {
      x[i] = exp2_floored(T(x[i] - sub[i]));
      sum[i] += x[i];
    }
  }
  //   max(m, x[0], ..., x[n-1]) (a NaN is skipped)
  static T max_row(const T* x, index_t n, T m) {
    for (index_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }
  //   x[i] = exp2(x[i] - sub); return sum(x)
  // Summed in double (see the x86 kernels: a float running sum drifts on long rows).
  static T exp2_sub_sum(T* x, index_t n, T sub) {
    double s = 0.0;
    for (index_t i = 0; i < n; ++i) {
      x[i] = exp2_floored(T(x[i] - sub));
      s += double(x[i]);
    }
    return T(s);
  }
  //   x[i] = exp2((x[i] - sub) * mul); return sum(x) (softmax's rows, in natural units)
  static T exp2_scaled_sum(T* x, index_t n, T sub, T mul) {
    double s = 0.0;
    for (index_t i = 0; i < n; ++i) {
      x[i] = exp2_floored(T((x[i] - sub) * mul));
      s += double(x[i]);
    }
    return T(s);
  }
};

// Block sizes: register tile MR x NR, cache blocks MC x KC x NC, attention key block BK.
struct sgemm_ukernel_4x16_generic : GenericKernels<float>, TransposeRef<float> {
  using T = float;
  static constexpr int MR = 4, NR = 16, NP = 2, NPW = 2;
  static constexpr index_t MC = 128, KC = 256, NC = 512, BK = 128;
  static void ukernel(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                      index_t ldc, int nr, bool accumulate) {
    gemm_ukernel_ref<T, MR, NR>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, accumulate);
  }
  template <bool CAP, bool ALIBI>
  static void ukernel_exp2(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                           index_t ldc, int nr, const T* sub, T* xmax, T* csum, const ScoreMods<T>& md, T base) {
    gemm_ukernel_ref<T, MR, NR>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, false);
    for (int r = 0; r < mr; ++r) mod_span<CAP, ALIBI>(c + r * ldc, nr, md, base - T(r), T(1));
    exp2_tile(mr, nr, c, ldc, sub, xmax, csum);
  }
};
struct dgemm_ukernel_4x8_generic : GenericKernels<double>, TransposeRef<double> {
  using T = double;
  static constexpr int MR = 4, NR = 8, NP = 2, NPW = 2;
  static constexpr index_t MC = 128, KC = 256, NC = 256, BK = 128;
  static void ukernel(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                      index_t ldc, int nr, bool accumulate) {
    gemm_ukernel_ref<T, MR, NR>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, accumulate);
  }
  template <bool CAP, bool ALIBI>
  static void ukernel_exp2(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                           index_t ldc, int nr, const T* sub, T* xmax, T* csum, const ScoreMods<T>& md, T base) {
    gemm_ukernel_ref<T, MR, NR>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, false);
    for (int r = 0; r < mr; ++r) mod_span<CAP, ALIBI>(c + r * ldc, nr, md, base - T(r), T(1));
    exp2_tile(mr, nr, c, ldc, sub, xmax, csum);
  }
};

#include "frame/instantiate.h"

}  // namespace generic

const IsaTable isa_generic =
    generic::make_table<generic::sgemm_ukernel_4x16_generic, generic::dgemm_ukernel_4x8_generic>("generic");

}  // namespace pyattn
