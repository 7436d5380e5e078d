// Exact merge of partial attention states (split-KV shards, Dask key chunks), instantiated per
// ISA so that its loops vectorise with each one's flags. Weights and sums in double: the states'
// float32 outputs round once, on the store.
//   M = max_i lse_i;  c_i = exp(lse_i - M) / sum_j exp(lse_j - M);  out = sum_i c_i o_i
#pragma once

template <class T>
struct Merge {
  // The row's weights c_i of the states that contribute (their indices in idx); returns the
  // number of those and sets lse. An empty state (lse -inf) is left out, whatever its output
  // holds; a NaN lse makes the row NaN (nan = true), as does a +inf one (its weight is inf/inf).
  static index_t weights(const MergeArgs& g, index_t r, double* c, index_t* idx, double& lse, bool& nan) {
    double M = -std::numeric_limits<double>::infinity();
    nan = false;
    for (index_t i = 0; i < g.n; ++i) {
      const double l = g.lses[i][r * g.l_s[i]];
      if (l != l) nan = true;
      M = l > M ? l : M;
    }
    if (nan || M == std::numeric_limits<double>::infinity()) {
      lse = nan ? std::numeric_limits<double>::quiet_NaN() : M;
      nan = true;
      return 0;
    }
    index_t m = 0;
    double s = 0.0;
    if (M != -std::numeric_limits<double>::infinity())
      for (index_t i = 0; i < g.n; ++i) {
        const double l = g.lses[i][r * g.l_s[i]];
        if (l == -std::numeric_limits<double>::infinity()) continue;
        c[m] = l == M ? 1.0 : std::exp(l - M);  // exp(0) is 1 exactly: one libm call a row fewer
        s += c[m];
        idx[m++] = i;
      }
    for (index_t i = 0; i < m; ++i) c[i] /= s;
    lse = m ? M + std::log(s) : M;
    return m;
  }

  //   o[d] = sum_i c_i x_i[d], summed in double
  static void row(const MergeArgs& g, index_t r, double* c, index_t* idx) {
    T* o = static_cast<T*>(g.out) + r * g.out_rs;
    double lse;
    bool nan;
    const index_t m = weights(g, r, c, idx, lse, nan);
    g.out_lse[r] = lse;
    const index_t Ev = g.Ev;
    if (nan || m == 0) {
      const T fill = nan ? std::numeric_limits<T>::quiet_NaN() : T(0);
      for (index_t d = 0; d < Ev; ++d) o[d] = fill;
      return;
    }
    const T* x0 = static_cast<const T*>(g.outs[idx[0]]) + r * g.o_rs[idx[0]];
    if (m == 1) {  // c = 1 exactly: a copy
      for (index_t d = 0; d < Ev; ++d) o[d] = x0[d];
      return;
    }
    // Two states at a time into a double accumulator chunk held on the stack.
    constexpr index_t CH = 256;
    double acc[CH];
    for (index_t d0 = 0; d0 < Ev; d0 += CH) {
      const index_t w = min_of<index_t>(CH, Ev - d0);
      const double c0 = c[0];
#pragma omp simd
      for (index_t d = 0; d < w; ++d) acc[d] = c0 * double(x0[d0 + d]);
      for (index_t i = 1; i < m; ++i) {
        const T* xi = static_cast<const T*>(g.outs[idx[i]]) + r * g.o_rs[idx[i]] + d0;
        const double ci = c[i];
#pragma omp simd
        for (index_t d = 0; d < w; ++d) acc[d] += ci * double(xi[d]);
      }
#pragma omp simd
      for (index_t d = 0; d < w; ++d) o[d0 + d] = T(acc[d]);
    }
  }

  static void run(const MergeArgs& g) {
    if (g.rows == 0) return;
    // Memory-bound: counted at a GEMM multiply-add per element read, the rate threads_for assumes.
    const int nt = threads_for(double(g.rows) * double(g.Ev) * double(g.n + 1), g.nthreads);
    const std::size_t bytes = std::size_t(g.n) * (sizeof(double) + sizeof(index_t));
    team(
        nt, [&] { return static_cast<double*>(scratch(0, bytes)); },
        [&](double* c, const Team& tm) {
          index_t* idx = reinterpret_cast<index_t*>(c + g.n);
          tm.for_each(g.rows, false, [&](index_t r) { row(g, r, c, idx); });
        });
  }
};
