// The x86 kernels written once over a per-ISA vector type `Ops` and instantiated by the AVX2
// and AVX-512 translation units (inside each one's namespace, compiled with its own flags); the
// AArch64 NEON unit instantiates them too (nothing here is x86-specific but the name).
//
// Ops provides: T, V (vector), Mask, L (lanes); mask(n) for lanes [0, n); load, maskload,
// store, maskstore, set1, zero, add, sub, mul, div, max, fma, abs, copysign, select_lt (a < b ?
// x : y), maskz (zero the lanes outside a mask), reduce_add (in sum_lanes's order where an Ops
// has sum_lanes, so one row's dot product has the same bits in every decode loop) and exp2; the float Ops also load
// half-precision rows (load_f16 / load_bf16 and their _n forms for the first n lanes). Every intrinsic lives in the Ops
// structs of kernels_<isa>.cpp; nothing here names one, so a float and a double kernel, or an AVX2 and an AVX-512 one,
// are the same schedule on different vectors.
#pragma once

// ------------------------------------------------------------------ elementwise functions

// tanh(x), a few ulp, for |x| >= 0.25 or NaN in some lane: x + x^3 P(x^2) / Q(x^2) below
// |x| = 0.625 (Cephes' tanh/tanhf), else 1 - 2 / (exp(2|x|) + 1) with the sign of x (no
// cancellation there: the result is above 0.55). NaN stays NaN; large |x| gives +-1. Out of line:
// its constants would otherwise take registers from the score tile it is inlined into.
template <class Ops>
static PYATTN_NOINLINE typename Ops::V tanh_wide(typename Ops::V x) {
  using T = typename Ops::T;
  using V = typename Ops::V;
  const V z = Ops::mul(x, x);
  V small;
  if constexpr (sizeof(T) == 4) {
    V p = Ops::set1(-5.70498872745e-3f);
    p = Ops::fma(p, z, Ops::set1(2.06390887954e-2f));
    p = Ops::fma(p, z, Ops::set1(-5.37397155531e-2f));
    p = Ops::fma(p, z, Ops::set1(1.33314422036e-1f));
    p = Ops::fma(p, z, Ops::set1(-3.33332819422e-1f));
    small = Ops::fma(Ops::mul(p, z), x, x);
  } else {
    V p = Ops::set1(-9.64399179425052238628e-1);
    p = Ops::fma(p, z, Ops::set1(-9.92877231001918586564e1));
    p = Ops::fma(p, z, Ops::set1(-1.61468768441708447952e3));
    V q = Ops::add(z, Ops::set1(1.12811678491632931402e2));
    q = Ops::fma(q, z, Ops::set1(2.23548839060100448583e3));
    q = Ops::fma(q, z, Ops::set1(4.84406305325125486048e3));
    small = Ops::fma(Ops::div(Ops::mul(p, z), q), x, x);
  }
  if (!Ops::any_ge(z, Ops::set1(T(0.390625)))) return small;  // every |x| < 0.625
  const V ax = Ops::abs(x);
  const V e = Ops::exp2(Ops::mul(ax, Ops::set1(T(2 * kLog2e))));
  const V one = Ops::set1(T(1));
  const V large = Ops::copysign(Ops::sub(one, Ops::div(Ops::set1(T(2)), Ops::add(e, one))), x);
  return Ops::select_lt(ax, Ops::set1(T(0.625)), small, large);
}

// tanh(x), a few ulp. A softcap's scores mostly lie well inside the cap: there (every |x| < 0.25,
// float) a degree-7 fit, within 0.6 ulp, inline; other vectors (and double) go to tanh_wide.
template <class Ops>
static PYATTN_ALWAYS_INLINE typename Ops::V tanh_v(typename Ops::V x) {
  using T = typename Ops::T;
  using V = typename Ops::V;
  if constexpr (sizeof(T) == 4) {
    const V z = Ops::mul(x, x);
    if (__builtin_expect(!Ops::any_ge(z, Ops::set1(0.0625f)), 1)) {
      V p = Ops::fma(Ops::set1(-5.143325031e-2f), z, Ops::set1(1.332426369e-1f));
      p = Ops::fma(p, z, Ops::set1(-3.333324194e-1f));
      return Ops::fma(Ops::mul(p, z), x, x);
    }
  }
  return tanh_wide<Ops>(x);
}

// A row of keys or values as the computation's vectors: T itself, or float16 / bfloat16
// converted in registers as it is read (the _n forms read only the first n lanes).
template <class Ops, class S>
static inline typename Ops::V load_as(const S* p) {
  if constexpr (std::is_same<S, f16_t>::value)
    return Ops::load_f16(p);
  else if constexpr (std::is_same<S, bf16_t>::value)
    return Ops::load_bf16(p);
  else if constexpr (std::is_same<S, std::int8_t>::value)
    return Ops::load_i8(p);
  else
    return Ops::load(p);
}
template <class Ops, class S>
static inline typename Ops::V load_as_n(typename Ops::Mask m, int n, const S* p) {
  if constexpr (std::is_same<S, f16_t>::value)
    return Ops::load_f16_n(m, n, p);
  else if constexpr (std::is_same<S, bf16_t>::value)
    return Ops::load_bf16_n(m, n, p);
  else if constexpr (std::is_same<S, std::int8_t>::value)
    return Ops::load_i8_n(m, n, p);
  else
    return Ops::maskload(m, p);
}

// ------------------------------------------------------------------ GEMM register tile
// An Ops may bring its own k loop, Ops::kloop<NV, M>(acc, k, a, rsa, csa, b, ldb) (NEON multiplies
// by a vector lane where x86 broadcasts); gemm_regtile then runs it in place of its own.
template <class Ops, class = void>
struct has_kloop : std::false_type {};
template <class Ops>
struct has_kloop<Ops, std::void_t<decltype(&Ops::template kloop<1, 1>)>> : std::true_type {};

// acc[M][NV] = A[M x k] B[k x NV*L]: M rows of A are broadcast (A read through rsa, csa), NV
// vectors of B are loaded per k step (rows ldb apart), M*NV accumulators stay in registers and
// are handed to the epilogue `epi`, inlined, so that they never leave the registers in between.
template <class Ops, int NV, int M, class Epi>
static PYATTN_ALWAYS_INLINE void gemm_regtile(index_t k, const typename Ops::T* a, index_t rsa, index_t csa,
                                              const typename Ops::T* b, index_t ldb, Epi&& epi) {
  using V = typename Ops::V;
  constexpr int L = Ops::L;
  V acc[M][NV];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = Ops::zero();
  if constexpr (has_kloop<Ops>::value) {
    Ops::template kloop<NV, M>(acc, k, a, rsa, csa, b, ldb);
    return epi(acc);
  }
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
// Distinct (Tag) instances for distinct callers: GCC specialises a static kernel for argument
// values that all of its calls share (a B panel NR wide), which a caller passing others undoes.
template <class Ops, int NVMAX, int MR, int Tag = 0>
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

// C[mr x nr] += A[mr x k] B[k x nr] as gemm_ukernel, with the registers starting from C's tile
// rather than from zero, so that each product is added to the running sum instead of to a sum
// from zero. Attention's P V blocks far from a query's largest scores (ALiBi, visited outward)
// hold weights near 2^-126 whose products sum from zero to subnormals, and every instruction that
// reads or writes one takes a microcode assist on Intel cores (ALiBi took 1.5x the plain time);
// added to C's sum, they round as normal numbers. Not gemm_ukernel's way: where C's tile comes
// from L2 (heads of 128) the loads ahead of the k loop cost plain attention 3-4%.
template <class Ops, int NVMAX, int MR>
static inline void gemm_ukernel_from_c(int mr, index_t k, const typename Ops::T* a, index_t rsa, index_t csa,
                                       const typename Ops::T* b, index_t ldb, typename Ops::T* c, index_t ldc, int nr,
                                       bool accumulate) {
  using V = typename Ops::V;
  constexpr int L = Ops::L;
  if (!accumulate) return gemm_ukernel<Ops, NVMAX, MR, 2>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, false);
  with_vectors<NVMAX, L>(nr, [&](auto vecs) {
    with_rows<MR>(mr, [&](auto rows) {
      constexpr int NV = decltype(vecs)::value, M = decltype(rows)::value;
      const bool whole = nr == NV * L;
      typename Ops::Mask m[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) m[v] = Ops::mask(nr - v * L);
      V acc[M][NV];
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          acc[r][v] = whole ? Ops::load(c + r * ldc + v * L) : Ops::maskload(m[v], c + r * ldc + v * L);
      if constexpr (has_kloop<Ops>::value) {
        Ops::template kloop<NV, M>(acc, k, a, rsa, csa, b, ldb);
      } else {
        for (index_t p = 0; p < k; ++p) {
          V bv[NV];
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) bv[v] = Ops::load(b + p * ldb + v * L);
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) {
            const V ar = Ops::set1(a[r * rsa + p * csa]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[r][v] = Ops::fma(ar, bv[v], acc[r][v]);
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          if (whole)
            Ops::store(c + r * ldc + v * L, acc[r][v]);
          else
            Ops::maskstore(m[v], c + r * ldc + v * L, acc[r][v]);
        }
    });
  });
}

// Lane indices 0 .. 15, for the ALiBi distances of a vector of columns.
template <class T>
alignas(64) static constexpr T kIota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// The score variants on an accumulator vector of row r (a key) whose lane l is column c = v*L + l
// (a query): s = cap * tanh(s) (CAP; s arrives divided by the cap), then s += nslope *
// |base + c - r| (ALIBI), with
// dcol[v] holding base + v*L + lane.
template <class Ops, bool CAP, bool ALIBI>
static PYATTN_ALWAYS_INLINE typename Ops::V apply_mods(typename Ops::V s, const ScoreMods<typename Ops::T>& md,
                                                       typename Ops::V dcol, int r) {
  using T = typename Ops::T;
  if constexpr (CAP) s = Ops::mul(Ops::set1(md.cap), tanh_v<Ops>(s));
  if constexpr (ALIBI) s = Ops::fma(Ops::set1(md.nslope), Ops::abs(Ops::sub(dcol, Ops::set1(T(r)))), s);
  return s;
}

// mods(s) + nsub, with the cap's product and the ALiBi term folded into FMAs (one operation a
// vector fewer than apply_mods then an add: the epilogue runs once per score).
template <class Ops, bool CAP, bool ALIBI>
static PYATTN_ALWAYS_INLINE typename Ops::V mods_plus(typename Ops::V s, const ScoreMods<typename Ops::T>& md,
                                                      typename Ops::V dcol, int r, typename Ops::V nsub) {
  using T = typename Ops::T;
  typename Ops::V rest = nsub;
  if constexpr (ALIBI) rest = Ops::fma(Ops::set1(md.nslope), Ops::abs(Ops::sub(dcol, Ops::set1(T(r)))), rest);
  if constexpr (CAP) return Ops::fma(Ops::set1(md.cap), tanh_v<Ops>(s), rest);
  return Ops::add(s, rest);
}

// The attention scores with the softmax numerator fused into the store, on the ceil(nr / L)
// vectors that hold the first nr columns (whole vectors are stored):
//   x = mods(A B) - sub (per column); xmax = max(xmax, colmax(x)); C = exp2(x); csum += colsum(C)
// so the score tile goes from registers to memory once, already exponentiated. mods are the score
// variants (apply_mods), base the ALiBi distance of row 0, column 0.
template <class Ops, int NVMAX, int MR, bool CAP, bool ALIBI>
static inline void gemm_ukernel_exp2(int mr, index_t k, const typename Ops::T* a, index_t rsa, index_t csa,
                                     const typename Ops::T* b, index_t ldb, typename Ops::T* c, index_t ldc, int nr,
                                     const typename Ops::T* sub, typename Ops::T* xmax, typename Ops::T* csum,
                                     const ScoreMods<typename Ops::T>& md, typename Ops::T base) {
  using T = typename Ops::T;
  using V = typename Ops::V;
  constexpr int L = Ops::L;
  run_tile<Ops, NVMAX, MR>(mr, nr, k, a, rsa, csa, b, ldb, [&](auto& acc) {
    constexpr int M = tile_rows<decltype(acc)>, NV = tile_vectors<decltype(acc)>;
    V sv[NV], mx[NV], sm[NV], dcol[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      sv[v] = Ops::sub(Ops::zero(), Ops::load(sub + v * L));  // -sub, added by mods_plus
      mx[v] = Ops::load(xmax + v * L);
      sm[v] = Ops::load(csum + v * L);
      if constexpr (ALIBI)
        dcol[v] = Ops::add(Ops::load(kIota<T>), Ops::set1(base + T(v * L)));
      else
        dcol[v] = Ops::zero();
    }
    auto rows = [&](auto linear) {
      // linear: every distance of the tile has one sign s (off the diagonal: most tiles), so
      // the bias nslope * |d| is nslope * s * (base + c - r): a column vector with -sub folded
      // in, less r * nslope * s per row, by one FMA (the sub and abs of mods_plus go).
      V step = Ops::zero();
      if constexpr (decltype(linear)::value) {
        const T ns = base >= T(0) ? md.nslope : -md.nslope;
        step = Ops::set1(ns);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) sv[v] = Ops::fma(step, dcol[v], sv[v]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        T* cr = c + r * ldc;
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          // linear: the row's bias and -sub by one FMA (one rounding, as mods_plus), then the cap
          const V x = decltype(linear)::value ? mods_plus<Ops, CAP, false>(acc[r][v], md, dcol[v], r,
                                                                           Ops::fma(Ops::set1(T(-r)), step, sv[v]))
                                              : mods_plus<Ops, CAP, ALIBI>(acc[r][v], md, dcol[v], r, sv[v]);
          mx[v] = Ops::max(mx[v], x);
          const V e = Ops::exp2(x);
          sm[v] = Ops::add(sm[v], e);
          Ops::store(cr + v * L, e);
        }
      }
    };
    // (without ALiBi both calls are the one plain instance)
    if (ALIBI && (base - T(M - 1) >= T(0) || base + T(NV * L - 1) <= T(0)))
      rows(std::bool_constant<ALIBI>{});
    else
      rows(std::false_type{});
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      Ops::store(xmax + v * L, mx[v]);
      Ops::store(csum + v * L, sm[v]);
    }
  });
}

// ------------------------------------------------------------------ row kernels
// The vector registers an Ops has (Ops::kRegs: AVX2's 16; 32 otherwise, AVX-512 and NEON): how
// many accumulators a row kernel may hold before the compiler spills them to the stack.
template <class O, class = void>
struct VecRegs : std::integral_constant<int, 32> {};
template <class O>
struct VecRegs<O, std::void_t<decltype(O::kRegs)>> : std::integral_constant<int, int(O::kRegs)> {};

template <class Ops>
struct VecKernels {
  using T = typename Ops::T;
  using V = typename Ops::V;
  static constexpr int L = Ops::L;
  // Accumulators of the P.V row kernels: half the registers, the rest for the V vectors (each
  // loaded once for all rows) and the broadcast weight. With 16 at AVX2's 16 registers, five of
  // them lived on the stack (a grouped decode's P.V ran 1.8x slower than AVX-512's on one Zen 4).
  static constexpr int kPvAcc = VecRegs<Ops>::value / 2;

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

  //   max(m, x[0], ..., x[n-1]) (a NaN is skipped on x86; on NEON it may hide its lane's other
  //   values, harmless as the row's output is NaN either way)
  // In L lanes, not one scalar chain: a decode block's max was a compare's latency per key.
  static T max_row(const T* x, index_t n, T m) {
    V acc = Ops::set1(m);
    index_t i = 0;
    for (; i + L <= n; i += L) acc = Ops::max(Ops::load(x + i), acc);
    const T r = Ops::reduce_max(acc);  // a shuffle tree: a scalar chain over the lanes was 16 compares' latency
    m = r > m ? r : m;
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }

  //   x[i] = exp2(x[i] - sub); return sum(x)
  // Summed in blocks of kSumBlock vectors whose totals are added in double: one float
  // accumulator per lane over a million-element row drifted by ~2e-4; this keeps the error
  // near a block's (~1e-6) at the cost of one horizontal sum per block.
  static constexpr index_t kSumBlock = 64;
  static T exp2_sub_sum(T* x, index_t n, T sub) {
    const V s = Ops::set1(sub);
    return exp2_sum_of(x, n, [s](V v) { return Ops::sub(v, s); });
  }

  //   x[i] = exp2(arg(x[i])); return sum(x), in kSumBlock blocks as above
  template <class Arg>
  static T exp2_sum_of(T* x, index_t n, Arg arg) {
    double total = 0.0;
    index_t i = 0;
    while (i + L <= n) {
      V acc = Ops::zero();
      const index_t end = min_of<index_t>(n - L + 1, i + kSumBlock * L);
      for (; i < end; i += L) {
        const V e = Ops::exp2(arg(Ops::load(x + i)));
        Ops::store(x + i, e);
        acc = Ops::add(acc, e);
      }
      total += double(Ops::reduce_add(acc));
    }
    if (i < n) {
      const typename Ops::Mask m = Ops::mask(int(n - i));
      const V e = Ops::maskz(m, Ops::exp2(arg(Ops::maskload(m, x + i))));
      Ops::maskstore(m, x + i, e);
      total += double(Ops::reduce_add(e));
    }
    return T(total);
  }

  //   x[i] = exp2((x[i] - sub) * mul); return sum(x). softmax's rows, kept in natural units up to
  //   here: x - sub <= 0 never overflows where x * mul could (|x| past max / log2(e)). Taken as
  //   one fma, x * mul - sub * mul, where sub * mul is at most 2^digits: its rounding then
  //   shifts every exponent alike by at most 1, which the normalisation cancels (-inf for a far
  //   smaller x is the right limit, a weight of 0). Past that the shift could leave exp2's range
  //   (a row [1e10, 0] gave NaN), so the difference is taken first.
  static T exp2_scaled_sum(T* x, index_t n, T sub, T mul) {
    const T nsm = -sub * mul;
    constexpr T exact = T(std::uint64_t(1) << std::numeric_limits<T>::digits);
    return std::fabs(nsm) <= exact ? exp2_scaled_sum_as<true>(x, n, Ops::set1(nsm), Ops::set1(mul))
                                   : exp2_scaled_sum_as<false>(x, n, Ops::set1(sub), Ops::set1(mul));
  }
  template <bool FMA>
  static T exp2_scaled_sum_as(T* x, index_t n, V s, V f) {
    return exp2_sum_of(x, n, [s, f](V v) { return FMA ? Ops::fma(v, f, s) : Ops::mul(Ops::sub(v, s), f); });
  }

  //   s[i] = mods(s[i]) for i < n, the ALiBi distance of element i being base + step*i: a row of
  //   a score tile (columns: queries, step 1) or of a decode block (keys, step -1).
  template <bool CAP, bool ALIBI>
  static void mod_span(T* s, index_t n, const ScoreMods<T>& md, T base, T step) {
    const V iota = Ops::load(kIota<T>);
    V d = Ops::fma(iota, Ops::set1(step), Ops::set1(base));
    const V dstep = Ops::set1(step * T(L));
    index_t i = 0;
    for (; i + L <= n; i += L, d = Ops::add(d, dstep))
      Ops::store(s + i, apply_mods<Ops, CAP, ALIBI>(Ops::load(s + i), md, d, 0));
    if (i < n) {
      const typename Ops::Mask m = Ops::mask(int(n - i));
      Ops::maskstore(m, s + i, apply_mods<Ops, CAP, ALIBI>(Ops::maskload(m, s + i), md, d, 0));
    }
  }

  //   dst[r*drs + c] = src[r*srs + c] for r < rows, c < cols, converted to T
  template <class S>
  static void convert_rows(const S* src, index_t srs, index_t rows, index_t cols, T* dst, index_t drs) {
    for (index_t r = 0; r < rows; ++r) {
      const S* sr = src + r * srs;
      T* dr = dst + r * drs;
      index_t c = 0;
      for (; c + L <= cols; c += L) Ops::store(dr + c, load_as<Ops>(sr + c));
      if (c < cols) {
        const int n = int(cols - c);
        const typename Ops::Mask m = Ops::mask(n);
        Ops::maskstore(m, dr + c, load_as_n<Ops>(m, n, sr + c));
      }
    }
  }

  // Decode helpers. Both read every K and V row front to back, one row after the other: that
  // order streams at memory speed, where reading several rows side by side (column-wise within
  // a block) confuses the prefetchers and runs at a third of it.

  //   s[r*ss] = q_r . k for RB rows q_r (qs apart): each vector of the K row is loaded once for
  //   all of them; one row keeps two accumulators to halve its FMA chain. One row is summed as
  //   dot_lanes sums it (even vectors, then a last odd one, in the first accumulator; a partial
  //   last vector in the second; Ops::reduce_add adds the lanes in sum_lanes's order), so that a query row's scores
  //   have the same bits whichever loop the decode takes: a paged cache streams key by key where
  //   a contiguous one may take L keys at a time, and the two must agree bit for bit.
  template <int RB, class S>
  static void dot_block(const T* q, index_t qs, const S* k, index_t n, T* s, index_t ss) {
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
        const V kv = load_as<Ops>(k + e + i * L);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) acc[r][i] = Ops::fma(Ops::load(q + r * qs + e + i * L), kv, acc[r][i]);
      }
    }
    for (; e < n; e += L) {
      const typename Ops::Mask m = Ops::mask(int(n - e));
      const V kv = load_as_n<Ops>(m, int(n - e), k + e);
      const int i = n - e < L ? NA - 1 : 0;  // (NA = 1: always 0)
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) acc[r][i] = Ops::fma(Ops::maskload(m, q + r * qs + e), kv, acc[r][i]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) s[r * ss] = Ops::reduce_add(NA == 2 ? Ops::add(acc[r][0], acc[r][NA - 1]) : acc[r][0]);
  }

  // Whether Ops can reduce L vectors to one vector of their sums at once (Ops::sum_lanes).
  template <class O, class = void>
  struct HasSumLanes : std::false_type {};
  // (sizeof: a vector type as a template argument drops its attributes, -Wignored-attributes)
  template <class O>
  struct HasSumLanes<O, std::void_t<decltype(sizeof(O::sum_lanes(static_cast<const typename O::V*>(nullptr))))>>
      : std::true_type {};

  //   s[j] = q . rows[j] for j < L (one query row): each key row read in order, into an
  //   accumulator of its own; the L accumulators reduced together (Ops::sum_lanes), a fraction of
  //   the cost of reducing each one. NV > 0: rows of exactly NV vectors, unrolled (the usual head
  //   sizes); NV = 0: any length n. PF: after key j, rows pk[j] (n long) and pv[j] (nv long)
  //   are prefetched, spread over the keys as the key-by-key loop spreads them.
  template <int NV, bool PF, class S>
  static void dot_lanes(const T* q, const S* const* rows, index_t n, T* s, const S* const* pk, const S* const* pv,
                        index_t nv_pf) {
    V acc[L];
    const index_t nv = NV > 0 ? NV : n / L, tail = NV > 0 ? 0 : n - nv * L;
    const typename Ops::Mask m = Ops::mask(int(tail));
#pragma GCC unroll 16
    for (int j = 0; j < L; ++j) {
      const S* k = rows[j];
      V a = Ops::zero(), b = Ops::zero();  // two chains: half the FMA latency per key
      index_t i = 0;
#pragma GCC unroll 8
      for (; i + 2 <= nv; i += 2) {
        a = Ops::fma(Ops::load(q + i * L), load_as<Ops>(k + i * L), a);
        b = Ops::fma(Ops::load(q + (i + 1) * L), load_as<Ops>(k + (i + 1) * L), b);
      }
      if (i < nv) a = Ops::fma(Ops::load(q + i * L), load_as<Ops>(k + i * L), a);
      if (NV == 0 && tail) b = Ops::fma(Ops::maskload(m, q + nv * L), load_as_n<Ops>(m, int(tail), k + nv * L), b);
      acc[j] = Ops::add(a, b);
      if constexpr (PF) {
        constexpr index_t line = index_t(64 / sizeof(S));
        for (index_t c = 0; c < n; c += line) PYATTN_PREFETCH_L2(pk[j] + c);
        for (index_t c = 0; c < nv_pf; c += line) PYATTN_PREFETCH_L2(pv[j] + c);
      }
    }
    Ops::store(s, Ops::sum_lanes(acc));
  }

  //   s[r*ss + j] = q_r . rows[j] for r < RB, j < KB (RB * KB <= L): one accumulator per pair,
  //   all reduced together (Ops::sum_lanes). Each vector of a key row is loaded once for all RB
  //   rows and each query vector once for all KB keys, where the key-by-key loop reloads the
  //   queries per key and reduces every pair on its own.
  template <int RB, int KB, class S>
  static void dot_group(const T* q, index_t qs, const S* const* rows, index_t n, T* s, index_t ss) {
    static_assert(RB * KB <= L, "one lane per pair");
    V acc[RB * KB];
#pragma GCC unroll 16
    for (int i = 0; i < RB * KB; ++i) acc[i] = Ops::zero();
    index_t e = 0;
    for (; e + L <= n; e += L) {
      V qv[RB];
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) qv[r] = Ops::load(q + r * qs + e);
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) {
        const V kv = load_as<Ops>(rows[j] + e);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) acc[r * KB + j] = Ops::fma(qv[r], kv, acc[r * KB + j]);
      }
    }
    if (e < n) {
      const int t = int(n - e);
      const typename Ops::Mask m = Ops::mask(t);
      V qv[RB];
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) qv[r] = Ops::maskload(m, q + r * qs + e);
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) {
        const V kv = load_as_n<Ops>(m, t, rows[j] + e);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) acc[r * KB + j] = Ops::fma(qv[r], kv, acc[r * KB + j]);
      }
    }
    // Copied out for sum_lanes: with acc itself passed to an out-of-line sum_lanes, GCC kept all
    // of acc on the stack, zeroed there and reloaded every call (grouped decode 1.04-1.07x slower).
    V all[L];  // the lanes past RB * KB zero
#pragma GCC unroll 16
    for (int i = 0; i < L; ++i) all[i] = i < RB * KB ? acc[i] : Ops::zero();
    T sum[L];
    Ops::store(sum, Ops::sum_lanes(all));
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) s[r * ss + j] = sum[r * KB + j];
  }

  //   s[x*ss + j] = q_x . rows[j] for x < R, j < kb. Where Ops has sum_lanes: one query row L
  //   keys at a time (decode without grouped heads), grouped rows L / 4 (or L / 2) keys at a time
  //   for four (two) rows; otherwise, and for the last keys, key by key. pk: one query row
  //   prefetches K row pk[j] (n long) and V row pv[j] (nv_pf long) after key j (dot_lanes).
  template <class S>
  static void dot_keys(const T* q, index_t qs, index_t R, const S* const* rows, index_t kb, index_t n, T* s, index_t ss,
                       const S* const* pk = nullptr, const S* const* pv = nullptr, index_t nv_pf = 0) {
    index_t j = 0;
    if constexpr (HasSumLanes<Ops>::value) {
      if (R == 1 && pk) {
        for (; j + L <= kb; j += L) lanes_of<true>(q, rows + j, n, s + j, pk + j, pv + j, nv_pf);
      } else if (R == 1) {
        for (; j + L <= kb; j += L) lanes_of<false>(q, rows + j, n, s + j, pk, pv, nv_pf);
      } else if constexpr (L >= 4) {  // (two-lane vectors: key by key)
        // L / 4 keys at a time, for every block of four rows, then two rows, then one: the
        // keys' rows stay in L1 across the row blocks
        constexpr int KB = L / 4;
        for (; j + KB <= kb; j += KB) {
          index_t x = 0;
          for (; x + 4 <= R; x += 4) dot_group<4, KB, S>(q + x * qs, qs, rows + j, n, s + x * ss + j, ss);
          for (; x + 2 <= R; x += 2) dot_group<2, KB, S>(q + x * qs, qs, rows + j, n, s + x * ss + j, ss);
          if (x < R) dot_group<1, KB, S>(q + x * qs, qs, rows + j, n, s + x * ss + j, ss);
        }
      }
    }
    for (; j < kb; ++j) dot_rows(q, qs, R, rows[j], n, s + j, ss);
  }

  // dot_lanes for the row length n: unrolled for the usual head sizes
  template <bool PF, class S>
  static void lanes_of(const T* q, const S* const* rows, index_t n, T* s, const S* const* pk, const S* const* pv,
                       index_t nv_pf) {
    if (n == 4 * L)
      dot_lanes<4, PF>(q, rows, n, s, pk, pv, nv_pf);
    else if (n == 8 * L)
      dot_lanes<8, PF>(q, rows, n, s, pk, pv, nv_pf);
    else if (n == 16 * L)
      dot_lanes<16, PF>(q, rows, n, s, pk, pv, nv_pf);
    else
      dot_lanes<0, PF>(q, rows, n, s, pk, pv, nv_pf);
  }

  //   s[x*ss] = q_x . k for x < R, the K row read in order, four query rows at a time
  template <class S>
  static void dot_rows(const T* q, index_t qs, index_t R, const S* k, index_t n, T* s, index_t ss) {
    index_t x = 0;
    for (; x + 4 <= R; x += 4) dot_block<4, S>(q + x * qs, qs, k, n, s + x * ss, ss);
    switch (R - x) {
      case 3: dot_block<3, S>(q + x * qs, qs, k, n, s + x * ss, ss); break;
      case 2: dot_block<2, S>(q + x * qs, qs, k, n, s + x * ss, ss); break;
      case 1: dot_block<1, S>(q + x * qs, qs, k, n, s + x * ss, ss); break;
      default: break;
    }
  }

  //   acc[r, :w] += sum_j p[r*ps + j] * rows[j][d0 : d0+w] for RB rows: NV vectors of each V row are
  //   loaded once for all RB rows, and the RB x NV accumulators stay in registers over the kb rows.
  //   PART: the last vector is partial (w < NV * L), read masked; whole vectors are read as
  //   such (AVX2 has no masked 16-bit or 8-bit load: a partial half or int8 row costs far more).
  //   The block's sum starts from zero and is added to acc once, as the prefill's micro-kernels
  //   do: registers starting from acc made a decode's output one float32 chain of FMAs over all
  //   its keys, whose error grew faster than the key count past ~128K keys (H8 D64 Lk 262144:
  //   87 ulp median against 5.7 for the same heads split into chunks).
  template <int NV, int RB, bool PART, class S>
  static void pv_block(const T* p, index_t ps, index_t kb, const S* const* rows, index_t d0, int w, T* acc,
                       index_t ldacc) {
    const int nlast = w - (NV - 1) * L;
    const typename Ops::Mask last = Ops::mask(nlast);
    auto ldt = [&](int i, const T* ptr) { return !PART || i < NV - 1 ? Ops::load(ptr) : Ops::maskload(last, ptr); };
    auto ld = [&](int i, const S* ptr) {
      return !PART || i < NV - 1 ? load_as<Ops>(ptr) : load_as_n<Ops>(last, nlast, ptr);
    };
    V a[RB][NV];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) a[r][i] = Ops::zero();
    for (index_t j = 0; j < kb; ++j) {
      const S* vr = rows[j] + d0;
      if constexpr (RB == 1) {
        // each V vector straight into its FMA: with all NV loaded first, AVX2's 16 registers held
        // 8 accumulators, 8 converted vectors and the weight, and one accumulator went to the
        // stack (a store-to-load chain through every key of an int8 row: 1.3x AVX-512's time)
        const V pj = Ops::set1(p[j]);
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) a[0][i] = Ops::fma(pj, ld(i, vr + i * L), a[0][i]);
      } else {
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
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      T* ar = acc + r * ldacc;
#pragma GCC unroll 8
      for (int i = 0; i < NV - 1; ++i) Ops::store(ar + i * L, Ops::add(ldt(i, ar + i * L), a[r][i]));
      const V tail = Ops::add(ldt(NV - 1, ar + (NV - 1) * L), a[r][NV - 1]);
      if constexpr (PART)
        Ops::maskstore(last, ar + (NV - 1) * L, tail);
      else
        Ops::store(ar + (NV - 1) * L, tail);
    }
  }

  // Vectors per column chunk for RB rows: RB x NV accumulators within kPvAcc, at most 8 vectors.
  static constexpr int pv_width(int rb) { return kPvAcc / rb < 8 ? kPvAcc / rb : 8; }

  // One column chunk of width w (nv = ceil(w / L) vectors, at most NV) for RB rows: the pv_block
  // instance for nv, counted down from NV at compile time, partial only when w is.
  template <int NV, int RB, class S>
  static void pv_chunk(int nv, const T* p, index_t ps, index_t kb, const S* const* rows, index_t d0, int w, T* acc,
                       index_t ldacc) {
    if constexpr (NV > 1)
      if (nv < NV) return pv_chunk<NV - 1, RB, S>(nv, p, ps, kb, rows, d0, w, acc, ldacc);
    if (w == NV * L)
      pv_block<NV, RB, false, S>(p, ps, kb, rows, d0, w, acc, ldacc);
    else
      pv_block<NV, RB, true, S>(p, ps, kb, rows, d0, w, acc, ldacc);
  }

  //   acc[x, :] += sum_j p[x*ps + j] * rows[j][:] for x < R (rows: one pointer per V row, so a
  //   paged cache's rows are read where they lie: rows four (or two, one) at a
  //   time, each V row chunk read once for all of them, in column chunks of pv_width(RB) vectors
  //   (kPvAcc accumulators).
  template <class S>
  static void pv_rows(const T* p, index_t ps, index_t R, index_t kb, const S* const* rows, index_t Ev, T* acc) {
    for (index_t x = 0; x < R;) {
      const int rb = R - x >= 4 ? 4 : R - x >= 2 ? 2 : 1;
      const index_t cw = index_t(pv_width(rb)) * L;
      for (index_t d0 = 0; d0 < Ev; d0 += cw) {
        const int w = int(Ev - d0 < cw ? Ev - d0 : cw);
        const T* px = p + x * ps;
        T* ax = acc + x * Ev + d0;
        const int nv = (w + L - 1) / L;
        if (rb == 4)
          pv_chunk<pv_width(4), 4, S>(nv, px, ps, kb, rows, d0, w, ax, Ev);
        else if (rb == 2)
          pv_chunk<pv_width(2), 2, S>(nv, px, ps, kb, rows, d0, w, ax, Ev);
        else
          pv_chunk<pv_width(1), 1, S>(nv, px, ps, kb, rows, d0, w, ax, Ev);
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
  // The same, for B read in place at any row stride (the short prefill's rows: K^T, V): an
  // instance of its own, so that the GEMM's and the panels' calls keep theirs specialised for
  // B panels NR wide (sharing one cost the AVX2 matmul micro-kernel 4% more instructions).
  static void ukernel_rows(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                           index_t ldc, int nr, bool acc) {
    gemm_ukernel<Ops, NV, MR, 1>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, acc);
  }
  // C += A B with the registers starting from C (attention's P V under ALiBi): an instance of
  // its own (gemm_ukernel_from_c).
  static void ukernel_from_c(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                             index_t ldc, int nr, bool acc) {
    gemm_ukernel_from_c<Ops, NV, MR>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, acc);
  }
  template <bool CAP, bool ALIBI>
  static void ukernel_exp2(int mr, index_t k, const T* a, index_t rsa, index_t csa, const T* b, index_t ldb, T* c,
                           index_t ldc, int nr, const T* sub, T* xmax, T* csum, const ScoreMods<T>& md, T base) {
    gemm_ukernel_exp2<Ops, NV, MR, CAP, ALIBI>(mr, k, a, rsa, csa, b, ldb, c, ldc, nr, sub, xmax, csum, md, base);
  }
};
