// The x86 kernels written once over a per-ISA vector type `Ops` and instantiated by the AVX2
// and AVX-512 translation units (inside each one's namespace, compiled with its own flags).
//
// Ops provides: T, V (vector), Mask, L (lanes); mask(n) for lanes [0, n); load, maskload,
// store, maskstore, set1, zero, add, sub, max, fma, maskz (zero the lanes outside a mask),
// reduce_add and exp2. Every intrinsic lives in the Ops structs of kernels_<isa>.cpp; nothing
// here names one, so a float and a double kernel, or an AVX2 and an AVX-512 one, are the same
// schedule on different vectors.
#pragma once

// ------------------------------------------------------------------ GEMM register tile
// acc[M][NV] = A[M x k] B[k x NV*L]: M rows of A are broadcast (A read through rsa, csa), NV
// vectors of B are loaded per k step (rows ldb apart), M*NV accumulators stay in registers and
// are handed to the epilogue `epi`, inlined, so that they never leave the registers in between.
template <class Ops, int NV, int M, class Epi>
static inline __attribute__((always_inline)) void gemm_regtile(index_t k, const typename Ops::T* a, index_t rsa,
                                                               index_t csa, const typename Ops::T* b, index_t ldb,
                                                               Epi&& epi) {
  using V = typename Ops::V;
  constexpr int L = Ops::L;
  V acc[M][NV];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = Ops::zero();
  for (index_t p = 0; p < k; ++p) {
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = Ops::load(b + v * L);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const V ar = Ops::set1(a[r * rsa]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = Ops::fma(ar, bv[v], acc[r][v]);
    }
    a += csa;
    b += ldb;
  }
  epi(acc);
}

// Calls f(std::integral_constant<int, M>) for M = mr, so each live row count 1..MR is its own
// fully unrolled instance.
template <int MR, class F>
static inline void with_rows(int mr, F&& f) {
  static_assert(MR >= 1 && MR <= 8, "register tiles have 1 to 8 rows");
#define PYATTN_ROWS(M)                                                 \
  case M:                                                              \
    if constexpr (MR >= M) return f(std::integral_constant<int, M>{}); \
    break;
  switch (mr) {
    PYATTN_ROWS(8)
    PYATTN_ROWS(7)
    PYATTN_ROWS(6)
    PYATTN_ROWS(5)
    PYATTN_ROWS(4)
    PYATTN_ROWS(3)
    PYATTN_ROWS(2)
    default: break;
  }
#undef PYATTN_ROWS
  f(std::integral_constant<int, 1>{});
}

// Calls f(std::integral_constant<int, N>) for N = ceil(nr / L) vectors (1..NV): a tile whose
// last columns are padding (a short query panel, an edge of C) computes only the vectors it uses.
template <int NV, int L, class F>
static inline void with_vectors(int nr, F&& f) {
  static_assert(NV >= 1 && NV <= 3, "register tiles have 1 to 3 vectors");
  const int nv = (nr + L - 1) / L;
  if constexpr (NV >= 3)
    if (nv >= 3) return f(std::integral_constant<int, 3>{});
  if constexpr (NV >= 2)
    if (nv == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

// The register tile of mr rows and ceil(nr / L) vectors (each shape its own instance) over k,
// its accumulators handed to epi(acc), a generic lambda that reads M and NV off acc's type.
template <class Ops, int NVMAX, int MR, class Epi>
static inline void run_tile(int mr, int nr, index_t k, const typename Ops::T* a, index_t rsa, index_t csa,
                            const typename Ops::T* b, index_t ldb, Epi&& epi) {
  with_vectors<NVMAX, Ops::L>(nr, [&](auto vecs) {
    with_rows<MR>(mr, [&](auto rows) {
      gemm_regtile<Ops, decltype(vecs)::value, decltype(rows)::value>(k, a, rsa, csa, b, ldb, epi);
    });
  });
}

template <class Acc>
constexpr int tile_rows = int(std::extent<std::remove_reference_t<Acc>, 0>::value);
template <class Acc>
constexpr int tile_vectors = int(std::extent<std::remove_reference_t<Acc>, 1>::value);

// C[mr x nr] (+)= A[mr x k] B[k x nr]: the ceil(nr / L) vectors that hold the first nr columns
// are computed, only the first nr columns of C are loaded and stored.
template <class Ops, int NVMAX, int MR>
static inline void gemm_ukernel(int mr, index_t k, const typename Ops::T* a, index_t rsa, index_t csa,
                                const typename Ops::T* b, index_t ldb, typename Ops::T* c, index_t ldc, int nr,
                                bool accumulate) {
  using T = typename Ops::T;
  constexpr int L = Ops::L;
  run_tile<Ops, NVMAX, MR>(mr, nr, k, a, rsa, csa, b, ldb, [&](auto& acc) {
    constexpr int M = tile_rows<decltype(acc)>, NV = tile_vectors<decltype(acc)>;
    if (nr == NV * L) {
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        T* cr = c + r * ldc;
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          Ops::store(cr + v * L, accumulate ? Ops::add(acc[r][v], Ops::load(cr + v * L)) : acc[r][v]);
      }
      return;
    }
    typename Ops::Mask m[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) m[v] = Ops::mask(nr - v * L);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      T* cr = c + r * ldc;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        Ops::maskstore(m[v], cr + v * L, accumulate ? Ops::add(acc[r][v], Ops::maskload(m[v], cr + v * L)) : acc[r][v]);
    }
  });
}

// The attention scores with the softmax numerator fused into the store, on the ceil(nr / L)
// vectors that hold the first nr columns (whole vectors are stored):
//   x = A B - sub (per column); xmax = max(xmax, colmax(x)); C = exp2(x); csum += colsum(C)
// so the score tile goes from registers to memory once, already exponentiated.
template <class Ops, int NVMAX, int MR>
static inline void gemm_ukernel_exp2(int mr, index_t k, const typename Ops::T* a, index_t rsa, index_t csa,
                                     const typename Ops::T* b, index_t ldb, typename Ops::T* c, index_t ldc, int nr,
                                     const typename Ops::T* sub, typename Ops::T* xmax, typename Ops::T* csum) {
  using T = typename Ops::T;
  using V = typename Ops::V;
  constexpr int L = Ops::L;
  run_tile<Ops, NVMAX, MR>(mr, nr, k, a, rsa, csa, b, ldb, [&](auto& acc) {
    constexpr int M = tile_rows<decltype(acc)>, NV = tile_vectors<decltype(acc)>;
    V sv[NV], mx[NV], sm[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      sv[v] = Ops::load(sub + v * L);
      mx[v] = Ops::load(xmax + v * L);
      sm[v] = Ops::load(csum + v * L);
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      T* cr = c + r * ldc;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const V x = Ops::sub(acc[r][v], sv[v]);
        mx[v] = Ops::max(mx[v], x);
        const V e = Ops::exp2(x);
        sm[v] = Ops::add(sm[v], e);
        Ops::store(cr + v * L, e);
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      Ops::store(xmax + v * L, mx[v]);
      Ops::store(csum + v * L, sm[v]);
    }
  });
}

// ------------------------------------------------------------------ row kernels
template <class Ops>
struct VecKernels {
  using T = typename Ops::T;
  using V = typename Ops::V;
  static constexpr int L = Ops::L;

  //   x[i] = exp2(x[i] - sub[i]); sum[i] += x[i]
  static void exp2_sub_cols(T* x, const T* sub, T* sum, int n) {
    int i = 0;
    for (; i + L <= n; i += L) {
      const V e = Ops::exp2(Ops::sub(Ops::load(x + i), Ops::load(sub + i)));
      Ops::store(x + i, e);
      Ops::store(sum + i, Ops::add(Ops::load(sum + i), e));
    }
    if (i < n) {
      const typename Ops::Mask m = Ops::mask(n - i);
      const V e = Ops::exp2(Ops::sub(Ops::maskload(m, x + i), Ops::maskload(m, sub + i)));
      Ops::maskstore(m, x + i, e);
      Ops::maskstore(m, sum + i, Ops::add(Ops::maskload(m, sum + i), e));
    }
  }

  //   x[i] = exp2(x[i] - sub); return sum(x)
  // Summed in blocks of kSumBlock vectors whose totals are added in double: one float
  // accumulator per lane over a million-element row drifted by ~2e-4; this keeps the error
  // near a block's (~1e-6) at the cost of one horizontal sum per block.
  static constexpr index_t kSumBlock = 64;
  static T exp2_sub_sum(T* x, index_t n, T sub) {
    const V s = Ops::set1(sub);
    double total = 0.0;
    index_t i = 0;
    while (i + L <= n) {
      V acc = Ops::zero();
      const index_t end = min_of<index_t>(n - L + 1, i + kSumBlock * L);
      for (; i < end; i += L) {
        const V e = Ops::exp2(Ops::sub(Ops::load(x + i), s));
        Ops::store(x + i, e);
        acc = Ops::add(acc, e);
      }
      total += double(Ops::reduce_add(acc));
    }
    if (i < n) {
      const typename Ops::Mask m = Ops::mask(int(n - i));
      const V e = Ops::maskz(m, Ops::exp2(Ops::sub(Ops::maskload(m, x + i), s)));
      Ops::maskstore(m, x + i, e);
      total += double(Ops::reduce_add(e));
    }
    return T(total);
  }

  // Decode helpers. Both read every K and V row front to back, one row after the other: that
  // order streams at memory speed, where reading several rows side by side (column-wise within
  // a block) confuses the prefetchers and runs at a third of it.

  //   s[r*ss] = q_r . k for RB rows q_r (qs apart): each vector of the K row is loaded once for
  //   all of them; one row keeps two accumulators to halve its FMA chain.
  template <int RB>
  static void dot_block(const T* q, index_t qs, const T* k, index_t n, T* s, index_t ss) {
    constexpr int NA = RB == 1 ? 2 : 1;
    V acc[RB][NA];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
      for (int i = 0; i < NA; ++i) acc[r][i] = Ops::zero();
    index_t e = 0;
    for (; e + NA * L <= n; e += NA * L) {
#pragma GCC unroll 2
      for (int i = 0; i < NA; ++i) {
        const V kv = Ops::load(k + e + i * L);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) acc[r][i] = Ops::fma(Ops::load(q + r * qs + e + i * L), kv, acc[r][i]);
      }
    }
    for (; e < n; e += L) {
      const typename Ops::Mask m = Ops::mask(int(n - e));
      const V kv = Ops::maskload(m, k + e);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) acc[r][0] = Ops::fma(Ops::maskload(m, q + r * qs + e), kv, acc[r][0]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) s[r * ss] = Ops::reduce_add(NA == 2 ? Ops::add(acc[r][0], acc[r][NA - 1]) : acc[r][0]);
  }

  //   s[x*ss] = q_x . k for x < R, the K row read in order, four query rows at a time
  static void dot_rows(const T* q, index_t qs, index_t R, const T* k, index_t n, T* s, index_t ss) {
    index_t x = 0;
    for (; x + 4 <= R; x += 4) dot_block<4>(q + x * qs, qs, k, n, s + x * ss, ss);
    switch (R - x) {
      case 3: dot_block<3>(q + x * qs, qs, k, n, s + x * ss, ss); break;
      case 2: dot_block<2>(q + x * qs, qs, k, n, s + x * ss, ss); break;
      case 1: dot_block<1>(q + x * qs, qs, k, n, s + x * ss, ss); break;
      default: break;
    }
  }

  //   acc[r, :w] += sum_j p[r*ps + j] * v[j*v_rs, :w] for RB rows: NV vectors of each V row are
  //   loaded once for all RB rows, and the RB x NV accumulators stay in registers over the kb rows.
  template <int NV, int RB>
  static void pv_block(const T* p, index_t ps, index_t kb, const T* v, index_t v_rs, int w, T* acc, index_t ldacc) {
    const typename Ops::Mask last = Ops::mask(w - (NV - 1) * L);
    auto ld = [&](int i, const T* ptr) { return i < NV - 1 ? Ops::load(ptr) : Ops::maskload(last, ptr); };
    V a[RB][NV];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) a[r][i] = ld(i, acc + r * ldacc + i * L);
    for (index_t j = 0; j < kb; ++j) {
      const T* vr = v + j * v_rs;
      V vv[NV];
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) vv[i] = ld(i, vr + i * L);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const V pj = Ops::set1(p[r * ps + j]);
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) a[r][i] = Ops::fma(pj, vv[i], a[r][i]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 8
      for (int i = 0; i < NV - 1; ++i) Ops::store(acc + r * ldacc + i * L, a[r][i]);
      Ops::maskstore(last, acc + r * ldacc + (NV - 1) * L, a[r][NV - 1]);
    }
  }

  // One column chunk of width w (at most CW = 16 / RB vectors) for RB rows.
  template <int RB>
  static void pv_chunk(const T* p, index_t ps, index_t kb, const T* v, index_t v_rs, int w, T* acc, index_t ldacc) {
    switch ((w + L - 1) / L) {
      case 8:
        if constexpr (RB <= 2) pv_block<8, RB>(p, ps, kb, v, v_rs, w, acc, ldacc);
        break;
      case 7:
        if constexpr (RB <= 2) pv_block<7, RB>(p, ps, kb, v, v_rs, w, acc, ldacc);
        break;
      case 6:
        if constexpr (RB <= 2) pv_block<6, RB>(p, ps, kb, v, v_rs, w, acc, ldacc);
        break;
      case 5:
        if constexpr (RB <= 2) pv_block<5, RB>(p, ps, kb, v, v_rs, w, acc, ldacc);
        break;
      case 4: pv_block<4, RB>(p, ps, kb, v, v_rs, w, acc, ldacc); break;
      case 3: pv_block<3, RB>(p, ps, kb, v, v_rs, w, acc, ldacc); break;
      case 2: pv_block<2, RB>(p, ps, kb, v, v_rs, w, acc, ldacc); break;
      default: pv_block<1, RB>(p, ps, kb, v, v_rs, w, acc, ldacc); break;
    }
  }

  //   acc[x, :] += sum_j p[x*ps + j] * v[j*v_rs, :] for x < R: rows four (or two, one) at a
  //   time, each V row chunk read once for all of them, in column chunks of 16 / RB vectors
  //   (16 accumulators).
  static void pv_rows(const T* p, index_t ps, index_t R, index_t kb, const T* v, index_t v_rs, index_t Ev, T* acc) {
    for (index_t x = 0; x < R;) {
      const int rb = R - x >= 4 ? 4 : R - x >= 2 ? 2 : 1;
      const index_t cw = (rb == 4 ? 4 : 8) * L;
      for (index_t d0 = 0; d0 < Ev; d0 += cw) {
        const int w = int(Ev - d0 < cw ? Ev - d0 : cw);
        const T* px = p + x * ps;
        T* ax = acc + x * Ev + d0;
        if (rb == 4)
          pv_chunk<4>(px, ps, kb, v + d0, v_rs, w, ax, Ev);
        else if (rb == 2)
          pv_chunk<2>(px, ps, kb, v + d0, v_rs, w, ax, Ev);
        else
          pv_chunk<1>(px, ps, kb, v + d0, v_rs, w, ax, Ev);
      }
      x += rb;
    }
  }
};

// What an ISA's kernel traits take from one register-tile shape (MR rows of A broadcast, NV
// vectors of B): the GEMM micro-kernel, its fused-exp2 variant for attention, the row kernels.
template <class Ops, int MR_, int NV>
struct RegTileKernels : VecKernels<Ops> {
  using T = typename Ops::T;
  static constexpr int MR = MR_, NR = NV * Ops::L;
  static void ukernel(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                      index_t ldc, int nr, bool acc) {
    gemm_ukernel<Ops, NV, MR>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, acc);
  }
  static void ukernel_exp2(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                           index_t ldc, int nr, const T* sub, T* xmax, T* csum) {
    gemm_ukernel_exp2<Ops, NV, MR>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, sub, xmax, csum);
  }
};
