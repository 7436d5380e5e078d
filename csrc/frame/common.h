// Shared helpers of the portable frame. Included by every ISA translation unit *inside* its
// own namespace (pyattn::PYATTN_ISA_NS) so that no inline symbol compiled with one ISA's
// flags can be picked by the linker for another ISA's code.
#pragma once

template <class T>
struct NumLimits;
template <>
struct NumLimits<float> {
  static constexpr float inf = std::numeric_limits<float>::infinity();
};
template <>
struct NumLimits<double> {
  static constexpr double inf = std::numeric_limits<double>::infinity();
};

// A profiling build (cmake -DPYATTN_PROFILE=ON, tools/profile.sh) keeps each attention phase a
// function of its own so that perf attributes samples to it; normal builds inline them.
#ifndef PYATTN_PHASE
#ifdef PYATTN_PROFILE
#define PYATTN_PHASE PYATTN_NOINLINE
#else
#define PYATTN_PHASE
#endif
#endif

inline index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }
inline index_t round_up(index_t a, index_t b) { return ceil_div(a, b) * b; }
template <class T>
inline T min_of(T a, T b) {
  return a < b ? a : b;
}
template <class T>
inline T max_of(T a, T b) {
  return a < b ? b : a;
}

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

// The one way the kernels go parallel. team(nt, setup, work) runs work(state, team) on each
// thread of a team of nt, with state = setup() made by that thread for itself (its scratch);
// nt <= 1 runs inline with no OpenMP region. Loops are shared with team.for_each(), an orphaned
// `omp for`. Nothing may escape an OpenMP region (an exception there is std::terminate): an
// exception from setup (std::bad_alloc) on any thread makes every thread skip work, and it is
// rethrown on the caller, where pybind11 turns it into MemoryError.
struct Team {
  bool parallel;
  int tid() const { return parallel ? omp_get_thread_num() : 0; }
  int size() const { return parallel ? omp_get_num_threads() : 1; }
  // f(i) for i in [0, n), spread over the team: one at a time on demand (dynamic, for tasks of
  // uneven cost) or in equal contiguous runs.
  template <class F>
  void for_each(index_t n, bool dynamic, F&& f) const {
    if (!parallel) {
      for (index_t i = 0; i < n; ++i) f(i);
    } else if (dynamic) {
#pragma omp for schedule(dynamic, 1)
      for (index_t i = 0; i < n; ++i) f(i);
    } else {
#pragma omp for schedule(static)
      for (index_t i = 0; i < n; ++i) f(i);
    }
  }
};

template <class Setup, class Work>
inline void team(int nt, Setup&& setup, Work&& work) {
  if (nt <= 1) {
    auto state = setup();
    work(state, Team{false});
    return;
  }
  note_team_started();
  std::exception_ptr error;
  bool failed = false;
#pragma omp parallel num_threads(nt)
  {
    decltype(setup()) state{};
    try {
      state = setup();
    } catch (...) {
#pragma omp critical(pyattn_team_error)
      {
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
#pragma omp barrier
    if (!failed) work(state, Team{true});
  }
  if (error) std::rethrow_exception(error);
}

// A setup for team() that needs no per-thread state.
inline int no_state() { return 0; }

// The score variants of attention as the kernels apply them, in log2 units: s = cap * tanh(s)
// when softcapped (scale * log2(e) / cap is folded into the queries, so the kernel's dot product
// is already tanh's argument), then s += nslope * |i + off - j| for ALiBi (nslope = -slope *
// log2(e)).
template <class T>
struct ScoreMods {
  T cap, nslope;
};

// float16 and bfloat16 to float, one value (the vector kernels convert whole rows in registers).
inline float to_float(bf16_t h) {
  const std::uint32_t u = std::uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(f16_t h) {
  const std::uint32_t sign = std::uint32_t(h.bits & 0x8000u) << 16, ex = (h.bits >> 10) & 0x1fu, man = h.bits & 0x3ffu;
  std::uint32_t u;
  if (ex == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf, NaN
  } else if (ex != 0) {
    u = sign | ((ex + 112) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    u = sign;  // +-0
  } else {     // subnormal: man * 2^-24, exact in float
    float f = float(man) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(std::int8_t x) { return float(x); }
template <class T>
inline T to_float(T x) {
  return x;
}

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

// exp2 never gives a subnormal: below 2^kExp2Floor, the smallest normal number, it gives 0. On
// Intel cores each instruction that reads or writes a subnormal takes a microcode assist (a
// hundred cycles or more): with peaked scores (ALiBi over long rows, large logits) the weights
// that fell there slowed attention 3x to 80x. Such a weight adds less than 2^-126 (2^-1022) of a
// value to a sum that holds a weight near 1. The floor is the normal range's, not a larger one:
// weights are taken against a running reference that ALiBi can put far above a row's largest
// score, and a higher floor dropped whole rows there.
template <class T>
constexpr int kExp2Floor = sizeof(T) == 4 ? -126 : -1022;
//   e = x < kExp2Floor ? 0 : 2^x (NaN stays NaN); the scalar rescale factors
template <class T>
inline T exp2_floored(T x) {
  return x < T(kExp2Floor<T>) ? T(0) : T(std::exp2(x));
}

//   2^n for a whole number n, 0 below the floor as exp2_floored (inf above the range), set in
//   the exponent field: the rescales by whole binades, one per query and block under ALiBi (a
//   libm exp2 there made ALiBi prefills 1.00-1.04x slower)
template <class T>
inline T exp2_whole(T n) {
  constexpr int kMant = sizeof(T) == 4 ? 23 : 52, kBias = sizeof(T) == 4 ? 127 : 1023;
  if (!(n >= T(kExp2Floor<T>))) return n == n ? T(0) : n;  // NaN stays NaN
  if (n > T(kBias)) return NumLimits<T>::inf;
  using U = typename std::conditional<sizeof(T) == 4, std::uint32_t, std::uint64_t>::type;
  const U bits = U(kBias + static_cast<int>(n)) << kMant;
  T r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// Taylor coefficients ln(2)^i / i! of 2^f = e^(f ln 2), i = 0..13: degree 7 suffices for float
// (|f| <= 1/2 leaves a truncation error below 0.1 ulp), degree 13 for double.
constexpr double kExp2Taylor[14] = {1.0,
                                    6.9314718055994530942e-01,
                                    2.4022650695910071233e-01,
                                    5.5504108664821579953e-02,
                                    9.6181291076284771620e-03,
                                    1.3333558146428443423e-03,
                                    1.5403530393381609954e-04,
                                    1.5252733804059840280e-05,
                                    1.3215486790144309488e-06,
                                    1.0178086009239699727e-07,
                                    7.0549116208011233298e-09,
                                    4.4455382718708114975e-10,
                                    2.5678435993488202578e-11,
                                    1.3691488853904124290e-12};

//   prefetch(p + r * rs + c) for r < rows, c < cols (one per cache line)
// Asks for rows [0, rows) of cols elements, rs apart, to be brought into L2 ahead of use: K and V
// rows are read by the attention kernels in place (never packed), and their first touch would
// otherwise stall on strided misses that the hardware prefetchers do not follow. With Write, for
// writing (the output rows, whose stores otherwise wait on every line). Always inlined: a call
// to a function that only prefetches may be dropped (attention.h, prefetch_slots).
template <bool Write = false, class T>
PYATTN_ALWAYS_INLINE void prefetch_rows(const T* p, index_t rs, index_t rows, index_t cols) {
  constexpr index_t line = 64 / sizeof(T);
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; c += line) {
      if constexpr (Write)
        PYATTN_PREFETCH_W(p + r * rs + c);
      else
        PYATTN_PREFETCH_L2(p + r * rs + c);
    }
}

// Scales a transpose may apply on the way, one per source column c (at(c)): none, one for all
// (the query panel's scale * log2(e)) or one each (a panel's 1 / l, on the way out), so that the
// tile is not swept a second time to scale it.
struct NoScale {};
template <class T>
struct UniformScale {
  T s;
  T at(index_t) const { return s; }
};
template <class T>
struct ColumnScale {
  const T* s;
  T at(index_t c) const { return s[c]; }
};
template <class T, class Scale>
inline T scaled(T x, const Scale& sc, index_t c) {
  if constexpr (std::is_same<Scale, NoScale>::value)
    return x;
  else
    return x * sc.at(c);
}

//   dst[c*drs + r] = src[r*srs + c] * scale(c)
template <class T, class Scale = NoScale>
inline void transpose_ref(const T* src, index_t srs, index_t rows, index_t cols, T* dst, index_t drs,
                          const Scale& sc = Scale{}) {
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) dst[c * drs + r] = scaled(src[r * srs + c], sc, c);
}

// A kernel set's transpose by transpose_ref (double everywhere, float in the portable set).
template <class T>
struct TransposeRef {
  template <class Scale = NoScale>
  static void transpose(const T* src, index_t srs, index_t rows, index_t cols, T* dst, index_t drs,
                        const Scale& sc = Scale{}) {
    transpose_ref<T>(src, srs, rows, cols, dst, drs, sc);
  }
};

//   s[j*stride] = -inf where a bool mask row is false; s[j*stride] += mask * unit for an
//   additive one (attention keeps its scores in base 2, unit = log2(e); softmax in natural units,
//   unit = 1). The row starts `off` elements into `mask` (uint8 for bool, T for additive) with
//   element stride cs (0 when broadcast).
template <class T>
inline void apply_mask_row(MaskKind kind, const void* mask, index_t off, index_t cs, index_t n, T* s, index_t stride,
                           T unit = T(kLog2e)) {
  if (kind == MaskKind::boolean) {
    const unsigned char* m = static_cast<const unsigned char*>(mask) + off;
    for (index_t j = 0; j < n; ++j)
      if (!m[j * cs]) s[j * stride] = -NumLimits<T>::inf;
  } else if (kind == MaskKind::additive) {
    const T* m = static_cast<const T*>(mask) + off;
    for (index_t j = 0; j < n; ++j) s[j * stride] += m[j * cs] * unit;
  }
}
