// The few compiler-specific spellings the core needs, for GCC and Clang (Linux, macOS) and for
// MSVC (cl.exe, the Windows wheels). Included before any namespace opens: by std_includes.h in the
// kernel translation units and by dispatch.cpp.
#pragma once

#include <cstddef>
#include <cstdlib>
#if defined(_WIN32)
#include <malloc.h>
#endif

#if defined(_MSC_VER) && !defined(__clang__)
#define PYATTN_MSVC 1
#include <intrin.h>
#else
#define PYATTN_MSVC 0
#endif

// Inline always: the GEMM register tile and the epilogues it calls must be inlined for their
// accumulators to stay in registers.
#if PYATTN_MSVC
#define PYATTN_ALWAYS_INLINE __forceinline
#define PYATTN_NOINLINE __declspec(noinline)
#else
#define PYATTN_ALWAYS_INLINE inline __attribute__((always_inline))
#define PYATTN_NOINLINE __attribute__((noinline))
#endif

// Prefetch one cache line for reading into L2 (the T1 hint).
#if PYATTN_MSVC && (defined(_M_X64) || defined(_M_IX86))
#define PYATTN_PREFETCH_L2(p) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1)
#elif PYATTN_MSVC
#define PYATTN_PREFETCH_L2(p) ((void)(p))
#else
#define PYATTN_PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#endif
// Prefetch one cache line about to be written: with GCC and Clang asking for it exclusive
// (x86: PREFETCHW, which the AVX2 and AVX-512 units are compiled for; Haswell, which lacks it,
// runs its opcode as a no-op, as 64-bit Windows relies on), with MSVC an L2 read prefetch.
#if PYATTN_MSVC
#define PYATTN_PREFETCH_W(p) PYATTN_PREFETCH_L2(p)
#else
#define PYATTN_PREFETCH_W(p) __builtin_prefetch((p), 1, 2)
#endif

namespace pyattn {
namespace portable {

// Memory `align`-aligned (a power of two; size a multiple of it), freed by aligned_free. The
// Windows CRT has no aligned_alloc: its aligned blocks come from _aligned_malloc and must go back
// through _aligned_free, never free().
inline void* aligned_alloc(std::size_t align, std::size_t size) {
#if defined(_WIN32)
  return _aligned_malloc(size, align);
#else
  return std::aligned_alloc(align, size);
#endif
}
inline void aligned_free(void* p) {
#if defined(_WIN32)
  _aligned_free(p);
#else
  std::free(p);
#endif
}

#if PYATTN_MSVC && (defined(_M_X64) || defined(_M_IX86))
// What GCC's __builtin_cpu_supports answers, from CPUID and XGETBV directly: the instructions
// (AVX2 + FMA + F16C; AVX-512 F/DQ/BW/VL) and the OS saving their registers on a context switch
// (XCR0: XMM and YMM state; for AVX-512 also the opmask and both halves of the ZMM state).
inline bool x86_has(bool avx512) {
  int r[4];
  __cpuid(r, 0);
  if (r[0] < 7) return false;
  __cpuid(r, 1);
  const unsigned ecx1 = unsigned(r[2]);
  const bool fma = ecx1 & (1u << 12), osxsave = ecx1 & (1u << 27), avx = ecx1 & (1u << 28), f16c = ecx1 & (1u << 29);
  if (!(fma && osxsave && avx && f16c)) return false;
  const unsigned long long xcr0 = _xgetbv(0);
  if ((xcr0 & 0x6) != 0x6) return false;
  __cpuidex(r, 7, 0);
  const unsigned ebx7 = unsigned(r[1]);
  if (!(ebx7 & (1u << 5))) return false;  // AVX2
  if (!avx512) return true;
  const unsigned need = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);  // F, DQ, BW, VL
  return (ebx7 & need) == need && (xcr0 & 0xe6) == 0xe6;
}
// __builtin_cpu_is("intel"): CPUID leaf 0's vendor string is "GenuineIntel" (EBX, EDX, ECX)
inline bool x86_is_intel() {
  int r[4];
  __cpuid(r, 0);
  return r[1] == 0x756e6547 && r[3] == 0x49656e69 && r[2] == 0x6c65746e;
}
#endif

}  // namespace portable
}  // namespace pyattn
