// Run-time choice of the kernel set, the thread count and per-thread scratch.
// Compiled with baseline flags only: it must run on any CPU to decide which kernels can.
#include "frame/api.h"
#include "frame/portable.h"

#include <omp.h>
#if !defined(_WIN32)
#include <pthread.h>
#endif
// libgomp (GCC's OpenMP runtime): its pool may be another library's (see on_fork_prepare)
#if defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define PYATTN_LIBGOMP 1
#include <dlfcn.h>
#else
#define PYATTN_LIBGOMP 0
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

namespace pyattn {

namespace {

#if defined(PYATTN_HAVE_X86)  // cpuid: only an x86 build asks (other targets have no such flags)
bool cpu_has_avx2() {
#if PYATTN_MSVC
  return portable::x86_has(false);
#else
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
}

bool cpu_has_avx512() {
#if PYATTN_MSVC
  return portable::x86_has(true);
#else
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
}
#endif

// The kernel set of that name if this build has it and this CPU can run it, else null: the one
// place that decides, for PYATTN_ISA, set_isa, available_isas and the default alike.
const IsaTable* table_for(const char* name) {
  if (std::strcmp(name, "generic") == 0) return &isa_generic;
#if defined(PYATTN_HAVE_X86)
  if (std::strcmp(name, "avx2") == 0) return cpu_has_avx2() ? &isa_avx2 : nullptr;
#if !defined(PYATTN_NO_AVX512)  // CMake PYATTN_AVX512=OFF (tools/sanitize.sh on a CPU without it)
  if (std::strcmp(name, "avx512") == 0) return cpu_has_avx512() ? &isa_avx512 : nullptr;
#endif
#endif
#if defined(PYATTN_HAVE_NEON)
  if (std::strcmp(name, "neon") == 0) return &isa_neon;  // Advanced SIMD: every AArch64 CPU has it
#endif
  return nullptr;
}

// Why the kernel set in use was chosen (show_config prints it), set with the choice; and whether
// PYATTN_ISA named a set that this CPU cannot run (the default was taken instead).
std::atomic<const char*> g_reason{""};
std::atomic<bool> g_env_rejected{false};

const IsaTable* best_table() {
  // PYATTN_ISA forces a path; an unknown or unsupported name falls back to the best one and
  // the Python layer reports it (it checks the variable against available_isas()).
  const char* env = std::getenv("PYATTN_ISA");
  if (env && *env) {  // empty: unset, as the Python layer reads it
    if (const IsaTable* t = table_for(env)) {
      g_reason.store("forced by PYATTN_ISA");
      return t;
    }
    g_env_rejected.store(true);
  }
  const char* why;
  const IsaTable* t = &isa_generic;
#if defined(PYATTN_HAVE_X86)
  if (const IsaTable* best = table_for("avx512")) {
    t = best;
    why = "the CPU has AVX-512 F/DQ/BW/VL";
  } else if (const IsaTable* next = table_for("avx2")) {
    t = next;
    why = cpu_has_avx512() ? "the CPU has AVX-512, but this build has no AVX-512 kernels (PYATTN_AVX512=OFF)"
                           : "the CPU has AVX2 and FMA but not AVX-512 F/DQ/BW/VL";
  } else {
    why = "the CPU lacks AVX2 or FMA: portable C++ kernels, several times slower";
  }
#elif defined(PYATTN_HAVE_NEON)
  t = &isa_neon;
  why = "AArch64: Advanced SIMD (NEON) is part of every AArch64 CPU";
#else
  why = "no SIMD kernels for this architecture: portable C++ kernels, several times slower";
#endif
  g_reason.store(why);
  return t;
}

std::atomic<const IsaTable*> g_isa{nullptr};
std::atomic<int> g_threads{0};
std::atomic<bool> g_team_started{false};  // this process has started an OpenMP team
std::atomic<bool> g_forked{false};        // ...and this is a child forked after that

#if !defined(_WIN32)  // Windows has no fork()
#if PYATTN_LIBGOMP
// omp_pause_resource_all of the runtime this library runs on, looked up (not linked: an older
// libgomp loaded first under the same name, libgomp.so.1, may lack it), or null.
using PauseAll = int (*)(omp_pause_resource_t);
PauseAll pause_all_of_our_runtime() {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&omp_get_max_threads), &info) || !info.dli_fname) return nullptr;
  void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!lib) return nullptr;
  auto* fn = reinterpret_cast<PauseAll>(dlsym(lib, "omp_pause_resource_all"));
  dlclose(lib);  // (the reference RTLD_NOLOAD took; the runtime stays, this library links it)
  return fn;
}
const PauseAll g_pause_all = pause_all_of_our_runtime();

// Runs in the parent just before fork(). libgomp keeps a pool of threads per thread that starts
// teams; a child inherits the forking thread's pool but not its threads, and its next team would
// wait on them forever. The pool may not be pyattn's: torch's wheel ships a libgomp.so.1 too,
// and a process that loads both ends up with one runtime, so torch's teams fill the same pool.
// Releasing it here (the parent makes a fresh one at its next team) leaves the child none.
void on_fork_prepare() {
  if (g_pause_all) g_pause_all(omp_pause_hard);
}
#endif

// Runs in the child of fork(): the child computes on one thread once the parent has run a
// pyattn team (no oversubscription from workers forked by the dozen). A child forked before any
// team keeps the full count (its first region makes a fresh pool).
void on_fork_child() {
  if (g_team_started.load(std::memory_order_relaxed)) g_forked.store(true, std::memory_order_relaxed);
}
#if PYATTN_LIBGOMP
[[maybe_unused]] const int g_atfork = pthread_atfork(on_fork_prepare, nullptr, on_fork_child);
#else
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, on_fork_child);
#endif
#endif

}  // namespace

const IsaTable& active_isa() {
  const IsaTable* t = g_isa.load(std::memory_order_acquire);
  if (!t) {
    t = best_table();
    g_isa.store(t, std::memory_order_release);
  }
  return *t;
}

bool set_active_isa(const char* name) {
  const IsaTable* t = table_for(name);
  if (!t) return false;
  g_reason.store("set by set_isa()");
  g_env_rejected.store(false);
  g_isa.store(t, std::memory_order_release);
  return true;
}

std::string isa_reason() {
  active_isa();  // the choice, and its reason, are made on first use
  std::string why = g_reason.load();
  if (g_env_rejected.load()) why = "PYATTN_ISA names no kernel set this CPU can run, so the default: " + why;
  return why;
}

int isa_supported(const char* name) { return table_for(name) != nullptr; }

int decode_prefetch_env() {
  static const int v = [] {
    const char* env = std::getenv("PYATTN_DECODE_PREFETCH");
    if (env && (std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0)) return *env == '1' ? 1 : 0;
    return -1;
  }();
  return v;
}

bool decode_prefetch_streams() {
  static const bool on = [] {
    if (decode_prefetch_env() >= 0) return decode_prefetch_env() == 1;
#if defined(PYATTN_HAVE_X86)
#if PYATTN_MSVC
    return !portable::x86_is_intel();
#else
    __builtin_cpu_init();
    return !__builtin_cpu_is("intel");
#endif
#else
    return true;
#endif
  }();
  return on;
}

// OpenMP's count (OMP_NUM_THREADS, else the CPUs), within set_num_threads' bound (_api._thread_count):
// an OMP_NUM_THREADS of 100000 would start that many threads for one call
int default_num_threads() {
  // (once: omp_get_num_procs asks the kernel for the affinity mask, a system call per pyattn call)
  static const int most = std::max(16, 4 * omp_get_num_procs());
  const int n = omp_get_max_threads();
  return n < 1 ? 1 : n > most ? most : n;
}

int get_num_threads() {
  if (g_forked.load(std::memory_order_relaxed)) return 1;
  int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : default_num_threads();
}

void set_num_threads(int n) { g_threads.store(n, std::memory_order_relaxed); }
int thread_setting() { return g_threads.load(std::memory_order_relaxed); }

void note_team_started() {
  if (!g_team_started.load(std::memory_order_relaxed)) g_team_started.store(true, std::memory_order_relaxed);
}

bool forked_after_team() { return g_forked.load(std::memory_order_relaxed); }

namespace {
struct ScratchSlot {
  void* ptr = nullptr;
  std::size_t size = 0;
  ~ScratchSlot() { portable::aligned_free(ptr); }
};
thread_local ScratchSlot t_scratch[8];
}  // namespace

void* scratch(int slot, std::size_t bytes) {
  ScratchSlot& s = t_scratch[slot];
  if (bytes > s.size) {
    portable::aligned_free(s.ptr);
    std::size_t sz = (bytes + 4095) & ~std::size_t(4095);  // whole pages: fewer regrowths
    s.ptr = portable::aligned_alloc(64, sz);
    if (!s.ptr) {
      s.size = 0;
      throw std::bad_alloc();
    }
    s.size = sz;
  }
  return s.ptr;
}

}  // namespace pyattn
