// The interface between the Python-facing glue and the compute kernels.
//
// Python validates and normalises every argument; these structs carry only pointers, sizes and
// strides (in elements, not bytes) and the kernels trust them. Nothing here depends on the
// instruction set: each ISA translation unit fills one `IsaTable` with its own entry points.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace pyattn {

// clang-format off: the argument structs keep each pointer with its strides on one line
using index_t = std::int64_t;

enum class Dtype : int { f32 = 0, f64 = 1 };

// C[b] = A[b] @ B[b] (or C[b] += when accumulate) for every batch entry b; A[b] starts at
// a + offa[b], likewise B, C. Any strides, including zero and negative ones.
struct GemmArgs {
  index_t m, n, k;
  const void* a; index_t rsa, csa;
  const void* b; index_t rsb, csb;
  void* c; index_t rsc, csc;
  index_t batch;
  const index_t* offa; const index_t* offb; const index_t* offc;  // batch offsets, or null for 0
  int nthreads;
};

enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

// Row softmax: out[r, :] = softmax(x[r, :] * scale + mask[r, :]) over `rows` rows of length n.
// Row r of x starts at x + xoff[r] with element stride xcs; same for out and mask.
struct SoftmaxArgs {
  index_t rows, n;
  const void* x; const index_t* xoff; index_t xcs;
  void* out; const index_t* ooff; index_t ocs;
  MaskKind mask_kind; const void* mask; const index_t* moff; index_t mcs;  // bool masks are uint8
  double scale;
  int nthreads;
};

// Scaled dot-product attention over `bh` independent (batch, head) problems.
// Problem i reads q + qoff[i] (Lq x E, row stride q_rs, unit feature stride), k + koff[i]
// (Lk x E), v + voff[i] (Lk x Ev) and writes out + ooff[i] (Lq x Ev, row stride o_rs).
// Consecutive groups of `group` problems share the same K and V (grouped-query heads); the
// kernels may use that to read K and V once for the whole group.
struct AttnArgs {
  index_t bh, Lq, Lk, E, Ev, group;
  const void* q; const index_t* qoff; index_t q_rs;
  const void* k; const index_t* koff; index_t k_rs;
  const void* v; const index_t* voff; index_t v_rs;
  void* out; const index_t* ooff; index_t o_rs;
  MaskKind mask_kind; const void* mask; const index_t* moff; index_t m_rs, m_cs;
  void* lse; const index_t* lseoff; index_t lse_s;      // optional: natural-log LSE per row
  void* weights; const index_t* woff; index_t w_rs;     // optional: zero-filled by the caller
  double scale;
  bool causal;                  // is_causal: query i sees no key j > i + off
  bool bottom_right;            // the alignment of causal, window and ALiBi: off = Lk_b - Lq, else 0
  // Score variants, in the order they apply (docs/api.md): softcap c (0: none); ALiBi slope and
  // sink logit per problem (natural units, T[bh], null: none); the window's sides (kNoLimit:
  // unbounded); the keys that exist per problem (index_t[bh], null: all Lk).
  double softcap;
  const void* alibi;
  const void* sinks;
  index_t win_left, win_right;
  const index_t* kv_lens;
  const index_t* q_lens;        // queries that exist per problem (index_t[bh], null: all Lq); the
                                // kernel writes no row past them (packed varlen layouts)
  // A paged cache (null block_table: contiguous). Key j of problem i is row j % block_size of
  // block block_table[bt_off[i] + j / block_size], the block's rows k_rs apart and blocks k_ps
  // apart from k + koff[i] (likewise V, and the int8 scales).
  const std::int32_t* block_table; const index_t* bt_off; index_t block_size, k_ps, v_ps;
  // int8 K/V: one float scale per key row (x = q * scale), addressed like the rows.
  const float* k_scale; const index_t* ksoff; index_t ks_rs, ks_ps;
  const float* v_scale; const index_t* vsoff; index_t vs_rs, vs_ps;
  int nthreads;
};

// Merge of n attention states over `rows` rows of Ev values (merge_attention_states):
//   M = max_i lse_i;  w_i = exp(lse_i - M), none for an empty state (lse_i = -inf);  s = sum w_i
//   out = sum_i (w_i / s) o_i;  out_lse = M + log(s)      (every state empty: zeros and -inf)
// State i's row r starts at outs[i] + r * o_rs[i] (unit element stride; o_rs 0 for a broadcast
// row), its lse is lses[i][r * l_s[i]] (float64); out row r at out + r * out_rs, out_lse[r].
struct MergeArgs {
  index_t n, rows, Ev;
  const void* const* outs; const index_t* o_rs;
  const double* const* lses; const index_t* l_s;
  void* out; index_t out_rs;
  double* out_lse;
  int nthreads;
};

// clang-format on

constexpr index_t kNoLimit = index_t(1) << 50;  // a window side with no bound

// Storage of half-precision keys and values (a float32 computation converts them as it reads).
struct f16_t {
  std::uint16_t bits;
};
struct bf16_t {
  std::uint16_t bits;
};

struct IsaTable {
  const char* name;
  void (*gemm[2])(const GemmArgs&);
  void (*softmax[2])(const SoftmaxArgs&);
  void (*attention[2])(const AttnArgs&);
  void (*attention_lowp[3])(const AttnArgs&);  // float32 compute with f16 [0], bf16 [1], int8 [2] K/V
  void (*merge[2])(const MergeArgs&);
};

// One table per compiled instruction set (defined in csrc/kernels/<isa>/).
extern const IsaTable isa_generic;
extern const IsaTable isa_avx2;
extern const IsaTable isa_avx512;
extern const IsaTable isa_neon;  // AArch64 only

// Process-wide state, defined in frame/dispatch.cpp (compiled for the baseline ISA only).
const IsaTable& active_isa();
bool set_active_isa(const char* name);  // false if unknown or unsupported by this CPU
std::string isa_reason();               // why the kernel set in use was chosen, in words
int isa_supported(const char* name);
// Whether the decode prefetches the K/V rows it streams, one row per key, when each key has one
// query row (no GQA group) and the rows lie in one contiguous run (no block table). That loop
// measured faster on Zen 5, the other (several keys a pass, no prefetches) on an Intel Xeon, and
// on Zen 3 each won on part of the cases (docs/performance.md has the figures). So: not on Intel,
// yes on every other CPU (only AMD's measured); PYATTN_DECODE_PREFETCH=0 or 1 decides instead.
// A kernel set may take the key-by-key loop for its long rows whatever this says
// (stream_keys_row_bytes, frame/attention.h: AVX2's rows of 512 bytes and more), unless the
// variable is set.
// Key rows of at most two cache lines never take it (frame/attention.h, decode_stream_keys).
// The same answer decides whether K/V of the cached size (16 MiB at most) read several keys a
// pass prefetch the rows two blocks ahead among them, where the kernel set asks for that
// (kPrefetchCachedRows: AVX-512).
bool decode_prefetch_streams();
int decode_prefetch_env();  // PYATTN_DECODE_PREFETCH: 0 or 1, -1 when unset (or neither)
int default_num_threads();
int get_num_threads();
void set_num_threads(int n);  // 0: unset, OpenMP's count (which threadpoolctl can limit)
int thread_setting();         // what set_num_threads last stored (0: unset)
// Called before every OpenMP region with more than one thread (frame/common.h's team()): a
// process forked after that cannot use GNU OpenMP's thread pool, whose threads are not copied
// into the child, so it computes on one thread (get_num_threads() returns 1 there).
void note_team_started();
bool forked_after_team();

// Per-thread, 64-byte aligned, grow-only scratch (slot 0..7) owned by the calling OS thread.
// Lives in the baseline TU so that no ISA translation unit emits shared inline symbols.
void* scratch(int slot, std::size_t bytes);

}  // namespace pyattn
