#!/usr/bin/env bash
# The machine's FMA peak per core, for 256-bit (AVX2) and 512-bit (AVX-512) vectors: 12
# independent FMA chains per thread, one thread per core. Where the two figures are equal the
# CPU runs 512-bit FMAs at half rate (as this project's development VM does), so AVX-512 code
# has no throughput edge over AVX2 code there; on a full-width host it has twice the peak.
# The program asks the CPU at run time (__builtin_cpu_supports) and measures only the widths it
# has: on a CPU without AVX-512F it prints the AVX2 figure and says there is no AVX-512.
#   bash tools/fma_peak.sh [threads] [count]
#   threads: default 2; count: floats through FMAs per thread, width and repeat (best of 5),
#   default 400000000; a small count such as 1000000 only checks that it runs (e.g. under an
#   emulator: qemu-x86_64 -cpu Haswell has no AVX-512).
set -euo pipefail
threads=${1:-2}
count=${2:-400000000}
if ! [[ $threads =~ ^[1-9][0-9]*$ && $count =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: bash tools/fma_peak.sh [threads] [count]  (positive integers)" >&2
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# One width per translation unit, each compiled with its own instruction set: the only code that
# can hold AVX2 or AVX-512 instructions is the one function each exports, and main (compiled for
# the baseline x86-64) calls it only when the CPU has them.
cat > "$work/width.cpp" <<'CPP'
#include <immintrin.h>
#include <omp.h>
namespace {
#if WIDTH == 512
using V = __m512;
constexpr int L = 16;
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
#elif WIDTH == 256
using V = __m256;
constexpr int L = 8;
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
#else
#error WIDTH must be 256 or 512
#endif
}  // namespace
#define NAME2(w) fma_gflops_##w
#define NAME(w) NAME2(w)
// GFLOP/s of all threads together, each thread pushing `n` floats (rounded down to whole rounds
// of 12 vectors) through FMAs.
extern "C" double NAME(WIDTH)(long n) {
  const long rounds = n / (12 * L);
  double t0 = omp_get_wtime();
  float sink = 0;
  int threads = 1;
#pragma omp parallel reduction(+ : sink)
  {
#pragma omp single
    threads = omp_get_num_threads();
    V a[12];
    for (int i = 0; i < 12; i++) a[i] = set1(i * 0.001f);
    const V b = set1(0.9999f), c = set1(0.0001f);
    for (long it = 0; it < rounds; it++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) a[i] = fma(a[i], b, c);
    }
    for (int i = 0; i < 12; i++) sink += reinterpret_cast<float*>(&a[i])[0];
  }
  double t = omp_get_wtime() - t0;
  static volatile float keep;
  keep = sink;  // keeps the chains live
  return 2.0 * rounds * 12 * L * threads / t / 1e9;
}
CPP
cat > "$work/main.cpp" <<'CPP'
#include <cstdio>
#include <cstdlib>
#include <omp.h>
extern "C" double fma_gflops_256(long n);
extern "C" double fma_gflops_512(long n);
int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 400000000;
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f");
  if (!avx2 && !avx512) {
    std::printf("this CPU has neither AVX2+FMA nor AVX-512F: nothing to measure\n");
    return 0;
  }
  (avx512 ? fma_gflops_512 : fma_gflops_256)(n / 4);  // warm-up: clocks and threads
  double y = 0, z = 0;
  for (int r = 0; r < 5; r++) {  // best of 5: the machine is shared
    if (avx2) {
      double a = fma_gflops_256(n);
      y = a > y ? a : y;
    }
    if (avx512) {
      double b = fma_gflops_512(n);
      z = b > z ? b : z;
    }
  }
  std::printf("threads %d: ", omp_get_max_threads());
  if (avx2)
    std::printf("AVX2 (256-bit) FMA peak %.0f GFLOP/s", y);
  else
    std::printf("AVX2 (256-bit): none (this CPU has no AVX2+FMA)");
  if (avx512)
    std::printf(", AVX-512 (512-bit) %.0f GFLOP/s\n", z);
  else
    std::printf(", AVX-512 (512-bit): none (this CPU has no AVX-512F)\n");
}
CPP
g++ -O2 -fopenmp -DWIDTH=256 -mavx2 -mfma -c "$work/width.cpp" -o "$work/width256.o"
g++ -O2 -fopenmp -DWIDTH=512 -mavx512f -c "$work/width.cpp" -o "$work/width512.o"
g++ -O2 -fopenmp "$work/main.cpp" "$work/width256.o" "$work/width512.o" -o "$work/peak"
OMP_NUM_THREADS=$threads OMP_PROC_BIND=spread "$work/peak" "$count"
