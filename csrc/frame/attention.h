// Flash-style fused attention, written once and instantiated per ISA and per storage of K/V.
//
// Prefill (any Lq): one task = one (batch*head, np query panels of NR queries: the kernel set's NP,
// or its NPW for heads of 128 and more, whose K/V rows are worth sharing wider). A panel works in
// the transposed orientation S^T = K Q^T so that the micro-kernel broadcasts K rows straight from
// memory and vectorises across queries: K and V are read in place, only the small Q^T tile is
// packed (with scale*log2(e) folded in; half-precision K/V blocks are converted into an L1 tile
// as they are read). Per key block (BK keys, fewer for narrow heads or a steep ALiBi slope):
//   S^T = mods(K_blk Q^T)                   (GEMM micro-kernel, A = K rows, B = Q^T)
//   m' = m, or colmax(S^T) where that exceeds m by over kSlack; a = exp2(m - m');
//   P^T = exp2(S^T - m'); l = a*l + colsum(P^T)
//   acc^T = a * acc^T + V_blk^T P^T         (GEMM micro-kernel, A = V^T, B = P^T)
// so every softmax statistic is a vector over the panel's queries. The reference m is a lazy
// running max: P <= 2^kSlack cannot overflow, the accumulator is rescaled only when a score
// jumps well past m, and once every query of a panel has a reference, an unmasked block needs
// no max pass at all: its exp2 (and the score variants, softcap and ALiBi) are fused into the
// score kernel's store (a block that turns out to exceed the slack is recomputed the two-pass
// way). The np panels of a task share each K and V row read. Only the keys a task's queries may
// see are visited: causal and window edges, and the valid length kv_lens, bound the key range,
// panels join and leave as it moves, and only the blocks that cross an edge are masked element
// by element. Scratch per thread is np * NR * (E + BK + Ev + 9) elements (plus BK * (E + Ev)
// for half K/V) whatever the sequence lengths, and at most 4 MiB more for a copy of strided K/V.
//
// Short prefill with a causal or window edge (at most 128 keys, 256 queries; prefill_rows): a
// row per query, as in the decode. S = Q K^T with Q read in place and one packed K^T per head
// group, each row's softmax whole (its keys all in one tile), O = P V stored straight into the
// output: no Q^T / O^T transposes per head, and the diagonal's masked halves go by rows.
//
// Decode (few queries, long Lk): one task = (group of heads sharing K/V, chunk of keys); all
// queries of the group are rows that share each K and V row read (converted in registers when
// half); chunks are merged exactly through their log-sum-exp, so both cores stream K/V even when
// batch*heads is 1. Sinks join each row's statistics once, when it is finished.
#pragma once

// Lanes of the kernel set's vectors (K::L), 1 for scalar kernels: the column granularity at which
// the micro-kernels compute a panel.
template <class K, class = void>
struct vector_lanes : std::integral_constant<int, 1> {};
template <class K>
struct vector_lanes<K, std::void_t<decltype(K::L)>> : std::integral_constant<int, int(K::L)> {};

// Whether the kernel set's single decode rows over cached-size K/V prefetch the rows ahead
// (K::kPrefetchCachedRows, decode_block); false where a set does not say.
template <class K, class = void>
struct prefetch_cached_rows : std::false_type {};
template <class K>
struct prefetch_cached_rows<K, std::void_t<decltype(K::kPrefetchCachedRows)>>
    : std::integral_constant<bool, K::kPrefetchCachedRows> {};

// Whether the kernel set's grouped decode rows over float32 / float16 / bfloat16 K/V streamed
// from memory take L / 4 keys at a time, as int8 rows do (K::kGroupedStreamKeys, decode_block);
// false (key by key) where a set does not say.
template <class K, class = void>
struct grouped_stream_keys : std::false_type {};
template <class K>
struct grouped_stream_keys<K, std::void_t<decltype(K::kGroupedStreamKeys)>>
    : std::integral_constant<bool, K::kGroupedStreamKeys> {};

// The key row size (bytes) from which the kernel set's single decode rows streamed from memory
// take the key-by-key loop with prefetches whatever the CPU's vendor (K::kStreamKeysRowBytes,
// decode_stream_keys); 0 (the vendor decides) where a set does not say.
template <class K, class = void>
struct stream_keys_row_bytes : std::integral_constant<index_t, 0> {};
template <class K>
struct stream_keys_row_bytes<K, std::void_t<decltype(K::kStreamKeysRowBytes)>>
    : std::integral_constant<index_t, K::kStreamKeysRowBytes> {};

// Whether the kernel set computes a block's scores a panel at a time (K::kPanelOuterScores,
// scores): each panel's Q^T stays in L1 while the block's K rows come from L2; else (where a set
// does not say) eight keys at a time across all panels, each K row read once, the panels' Q^T
// cycled through L1.
template <class K, class = void>
struct panel_outer_scores : std::false_type {};
template <class K>
struct panel_outer_scores<K, std::void_t<decltype(K::kPanelOuterScores)>>
    : std::integral_constant<bool, K::kPanelOuterScores> {};

// The GEMM micro-kernel the short prefill's rows call (K::ukernel_rows, B at any row stride),
// K::ukernel where a set has no instance of its own.
template <class K, class = void>
struct rows_ukernel {
  template <class... A>
  static void call(A... args) {
    K::ukernel(args...);
  }
};
template <class K>
struct rows_ukernel<K, std::void_t<decltype(&K::ukernel_rows)>> {
  template <class... A>
  static void call(A... args) {
    K::ukernel_rows(args...);
  }
};

// The GEMM micro-kernel that adds to C with its registers starting from C's tile
// (K::ukernel_from_c: attention's P V under ALiBi), K::ukernel where a set has no such instance.
template <class K, class = void>
struct from_c_ukernel {
  template <class... A>
  static void call(A... args) {
    K::ukernel(args...);
  }
};
template <class K>
struct from_c_ukernel<K, std::void_t<decltype(&K::ukernel_from_c)>> {
  template <class... A>
  static void call(A... args) {
    K::ukernel_from_c(args...);
  }
};

// Keys per prefill block where E and Ev are under 128 (K::BKN, at most K::BK); K::BK where a
// set does not say.
template <class K, class = void>
struct narrow_block_keys : std::integral_constant<index_t, K::BK> {};
template <class K>
struct narrow_block_keys<K, std::void_t<decltype(K::BKN)>> : std::integral_constant<index_t, K::BKN> {};

template <class K, class KV = typename K::T>
struct Attention {
  using T = typename K::T;
  static constexpr int MR = K::MR, NR = K::NR, BK = K::BK, VL = vector_lanes<K>::value;
  static constexpr index_t BKN = narrow_block_keys<K>::value;
  static_assert(BKN <= BK, "the tiles hold BK keys");
  static constexpr int kMaxNP = K::NP > K::NPW ? K::NP : K::NPW;
  static constexpr T kInf = NumLimits<T>::inf;
  static constexpr bool kHalf = !std::is_same<KV, T>::value;           // K/V stored as float16 / bfloat16 / int8
  static constexpr bool kInt8 = std::is_same<KV, std::int8_t>::value;  // ...int8, with a scale per row
  // How far (log2 units) a score may exceed its query's reference before the reference moves:
  // P <= 256 keeps l and acc far from overflow, as in FlashAttention-4's conditional rescaling.
  static constexpr T kSlack = T(8);

  const AttnArgs& a;
  const T* query;
  const KV *key, *value;   // read in place: only the small Q^T panel tile is ever packed
  T *out, *lse, *weights;  // lse and weights are null unless asked for
  T s2;                    // scale * log2(e), folded into Q (divided by the cap with a softcap)
  ScoreMods<T> mods0;      // softcap in log2 units; nslope is per problem
  const T *slopes, *sinks;
  index_t wl, wr;           // window sides (kNoLimit: none); wr is at most 0 with causal
  bool gather_k, gather_v;  // whether K / V blocks are copied into the task's tiles (gathers_rows)
  bool hold_k, hold_v;      // whether K / V rows may go into a thread's copy of a problem's (holds_rows)

  explicit Attention(const AttnArgs& args)
      : a(args),
        query(static_cast<const T*>(args.q)),
        key(static_cast<const KV*>(args.k)),
        value(static_cast<const KV*>(args.v)),
        out(static_cast<T*>(args.out)),
        lse(static_cast<T*>(args.lse)),
        weights(static_cast<T*>(args.weights)),
        s2(T(args.scale * kLog2e / (args.softcap > 0 ? args.softcap * kLog2e : 1.0))),
        slopes(static_cast<const T*>(args.alibi)),
        sinks(static_cast<const T*>(args.sinks)),
        wl(args.win_left),
        wr(args.causal ? min_of<index_t>(args.win_right, 0) : args.win_right),
        gather_k(gathers_rows(args, args.k_rs, args.E)),
        gather_v(gathers_rows(args, args.v_rs, args.Ev)),
        hold_k(holds_rows(args, args.k_rs, args.E)),
        hold_v(holds_rows(args, args.v_rs, args.Ev)) {
    mods0 = ScoreMods<T>{T(args.softcap * kLog2e), T(0)};
  }

  // One (batch, head) problem: Lq queries and Lk keys exist (q_lens, kv_lens), query i is
  // aligned with key i + off, and sees keys [lo(i), hi(i)) (causal and window; empty when
  // lo >= hi); in a paged cache its keys' blocks are listed from block_table[bt0].
  struct Problem {
    index_t bh, Lq, Lk, off, bt0;
    index_t bk;       // keys per block
    ScoreMods<T> md;  // with this head's ALiBi slope
  };
  Problem problem(index_t bh) const {
    Problem p;
    p.bh = bh;
    p.Lq = a.q_lens ? a.q_lens[bh] : a.Lq;
    p.Lk = a.kv_lens ? a.kv_lens[bh] : a.Lk;
    p.off = a.bottom_right ? p.Lk - p.Lq : 0;
    p.bt0 = a.block_table ? a.bt_off[bh] : 0;
    p.md = mods0;
    if (slopes) p.md.nslope = -slopes[bh] * T(kLog2e);
    p.bk = block_keys(p.md.nslope);
    return p;
  }

  // How many keys some query of problem p may see by position: [lo(p, 0), hi(p, Lq - 1)). Tasks
  // over problems of one span cost alike (prefill and decode take those in equal runs).
  index_t key_span(const Problem& p) const { return hi(p, a.Lq - 1) - lo(p, 0); }

  // Keys per prefill block: BK (BKN where E and Ev are under 128), or fewer under a steep ALiBi
  // slope (without a mask, which sends every block the two-pass way anyway), whose bias rises by
  // |nslope| a key (log2 units). anticipate_bias takes a block's rise ahead only while it and the
  // raw scores' spread stay within kRiseMax; past it the block goes the two-pass way, as every block
  // of a head of slope 0.5 did in AVX2's 256-key blocks (ALiBi then took 1.34x the plain causal
  // time) and of slopes near 1 (32 heads) in 128-key ones. Blocks over which the bias rises by at
  // most kBlockRise (down to MR keys) leave the rest of kRiseMax to the raw scores (A/B, 1.08-1.41x
  // faster on AVX2, 1.13-1.27x on AVX-512 with 16 or 32 heads; slope 0.5: 84-88 keys).
  static constexpr T kRiseMax = T(sizeof(T) == 4 ? 100 : 996);  // (anticipate_bias)
  static constexpr T kBlockRise = T(0.64) * kRiseMax;
  index_t block_keys(T nslope) const {
    const index_t bk = a.E >= 128 || a.Ev >= 128 ? BK : BKN;
    const T rise = nslope < T(0) ? -nslope : nslope;
    if (a.mask_kind != MaskKind::none || !(rise * T(bk) > kBlockRise)) return bk;
    return max_of<index_t>(MR, index_t(kBlockRise / rise) / MR * MR);
  }

  // Element offset of key row j of problem p in an array addressed by (off, rs, ps): rows rs apart,
  // or in a paged cache row j % block_size of block block_table[bt0 + j / block_size] (blocks ps
  // apart). Rows are contiguous for run(j) of them from j on.
  index_t row_at(const Problem& p, const index_t* off, index_t rs, index_t ps, index_t j) const {
    if (!a.block_table) return off[p.bh] + j * rs;
    return off[p.bh] + index_t(a.block_table[p.bt0 + j / a.block_size]) * ps + (j % a.block_size) * rs;
  }
  index_t run(index_t j) const { return a.block_table ? a.block_size - j % a.block_size : kNoLimit; }
  const KV* key_row(const Problem& p, index_t j) const { return key + row_at(p, a.koff, a.k_rs, a.k_ps, j); }
  const KV* value_row(const Problem& p, index_t j) const { return value + row_at(p, a.voff, a.v_rs, a.v_ps, j); }
  // Rows [j0, j0 + n) of K (or V) asked for into L2, run by run. (Always inlined: prefetch_rows.)
  PYATTN_ALWAYS_INLINE void prefetch_keys(const Problem& p, index_t j0, index_t n) const {
    for (index_t j = j0, e = j0 + n; j < e;) {
      const index_t m = min_of<index_t>(e - j, run(j));
      prefetch_rows(key_row(p, j), a.k_rs, m, a.E);
      j += m;
    }
  }
  PYATTN_ALWAYS_INLINE void prefetch_values(const Problem& p, index_t j0, index_t n) const {
    for (index_t j = j0, e = j0 + n; j < e;) {
      const index_t m = min_of<index_t>(e - j, run(j));
      prefetch_rows(value_row(p, j), a.v_rs, m, a.Ev);
      j += m;
    }
  }

  index_t lo(const Problem& p, index_t i) const { return min_of<index_t>(p.Lk, max_of<index_t>(0, i + p.off - wl)); }
  index_t hi(const Problem& p, index_t i) const {
    return max_of<index_t>(0, min_of<index_t>(p.Lk, i + p.off + wr + 1));
  }

  // ---------------------------------------------------------------- prefill (query tiles)

  // One query panel's state: NR queries, each a column of the transposed tiles. Every buffer
  // has one role; the vectors of per-query statistics are NR long.
  struct Tile {
    T* qt;       // E x NR: the panel's queries, transposed, scaled by s2, 0 past nr in its vector
    T* st;       // BK x NR: S^T of the current key block, then P^T in place
    T* acc;      // Ev x NR: the unnormalised output, transposed
    T* m;        // reference per query (log2 units): -inf until a key was visible
    T* l;        // sum of P per query, relative to m
    T* sub;      // exponent offset: m, or 0 where m = -inf (so exp2(-inf - sub) = 0, never NaN)
    T* alpha;    // rescale of l and acc by the last two-pass update
    T* cmax;     // column max of the block's scores (fused path: of S^T - sub)
    T* csum;     // column sums of the block's P^T
    T* inv;      // 1 / l (0 where no key was visible, NaN where l is), once the panel is finished
    T* bhw;      // ALiBi: the largest bias of the blocks taken in so far (see anticipate_bias)
    T* top;      // the largest score taken in so far (log2 units; see lower_reference)
    bool ready;  // every m is finite: unmasked blocks may take the fused path
    bool fresh;  // no key block taken in yet: l is 0 and acc, unwritten, means 0 (the first
                 // block's accumulate writes it: zeroing it per panel cost 5% of a short call)
    int nr;      // the panel's real queries: kernels compute only the vectors that hold them,
                 // and the rest of st holds finite filler
  };
  static constexpr int kStatVectors = 9;  // m, l, sub, alpha, cmax, csum, inv, bhw, top

  // Elements of one panel's scratch: qt + st + acc + the statistics vectors.
  static std::size_t tile_elems(index_t E, index_t Ev) {
    return std::size_t(NR) * std::size_t(E + BK + Ev + kStatVectors);
  }

  Tile carve(T* base) const {
    Tile t;
    t.qt = base;
    t.st = t.qt + a.E * NR;
    t.acc = t.st + BK * NR;
    T* stats = t.acc + a.Ev * NR;
    T** vecs[kStatVectors] = {&t.m, &t.l, &t.sub, &t.alpha, &t.cmax, &t.csum, &t.inv, &t.bhw, &t.top};
    for (int i = 0; i < kStatVectors; ++i) *vecs[i] = stats + i * NR;
    t.ready = false;
    t.fresh = true;
    t.nr = NR;
    return t;
  }

  // A panel about to take in its first key block: no reference, nothing accumulated.
  void reset_panel(Tile& t) const {
    for (int c = 0; c < NR; ++c) {
      t.m[c] = -kInf;
      t.l[c] = T(0);
      t.sub[c] = T(0);
      t.alpha[c] = T(1);
      t.bhw[c] = -kInf;
      t.top[c] = -kInf;
    }
    t.ready = false;
    t.fresh = true;
  }

  // acc^T[d, c] *= f[c] for every value column d (nothing while acc is still 0)
  void scale_acc(Tile& t, const T* f) const {
    if (t.fresh) return;
    for (index_t d = 0; d < a.Ev; ++d) {
      T* ad = t.acc + d * NR;
#pragma omp simd
      for (int c = 0; c < t.nr; ++c) ad[c] *= f[c];  // the columns past nr were never written
    }
  }

  // qt[e*NR + q] = Q[q0+q, e] * s2, zero beyond the qc real queries up to the end of their last
  // vector (the kernels read no further).
  PYATTN_PHASE void pack_qt(const T* q, index_t qc, T* qt) const {
    const index_t end = min_of<index_t>(NR, ceil_div(qc, index_t(VL)) * VL);
    for (index_t e = 0; e < a.E; ++e)
      for (index_t c = qc; c < end; ++c) qt[e * NR + c] = T(0);
    K::transpose(q, a.q_rs, qc, a.E, qt, NR, UniformScale<T>{s2});
  }

  // The rows [jl, jh) of a block of kb keys from k0 that query qi of problem p may see by position
  // (causal, window, kv_lens); jl = jh when none.
  std::pair<index_t, index_t> seen(const Problem& p, index_t qi, index_t k0, index_t kb) const {
    const index_t jl = min_of<index_t>(kb, max_of<index_t>(0, lo(p, qi) - k0));
    return {jl, max_of<index_t>(jl, min_of<index_t>(kb, hi(p, qi) - k0))};
  }

  // s[j*stride] = -inf where key k0+j (j < kb) is hidden from query qi of problem p (outside
  // [lo, hi): causal, window, kv_lens; or a false bool mask); an additive mask is added to the
  // keys the query sees (a NaN or inf entry at a hidden key changes nothing, as in the reference). The
  // decode rows' masking; the prefill tiles set the edges by rows (mask_edges), then apply_mask.
  PYATTN_PHASE void mask_row(const Problem& p, index_t qi, index_t k0, index_t kb, T* s, index_t stride) const {
    const auto [jl, jh] = seen(p, qi, k0, kb);
    for (index_t j = 0; j < jl; ++j) s[j * stride] = -kInf;
    for (index_t j = jh; j < kb; ++j) s[j * stride] = -kInf;
    apply_mask(p, qi, k0 + jl, jh - jl, s + jl * stride, stride);
  }

  // The call's mask on query qi's scores of keys k0..k0+kb (s[j*stride]), if it has one.
  void apply_mask(const Problem& p, index_t qi, index_t k0, index_t kb, T* s, index_t stride) const {
    if (a.mask_kind != MaskKind::none)
      apply_mask_row(a.mask_kind, a.mask, a.moff[p.bh] + qi * a.m_rs + k0 * a.m_cs, a.m_cs, kb, s, stride);
  }

  // Whether keys [k0, k0+kb) are all visible to queries qa..qz: no mask, and the block inside
  // the first query's right edge and the last query's left edge.
  bool unmasked(const Problem& p, index_t qa, index_t qz, index_t k0, index_t kb) const {
    return a.mask_kind == MaskKind::none && k0 + kb <= hi(p, qa) && k0 >= lo(p, qz);
  }

  // A key block as the kernels read it: in place for float K/V in a contiguous cache (rows a page
  // apart aside: gathers_rows), else gathered run by run (paged) and converted (half, int8 times
  // its row scales) into the task's tiles kc (BK x E) and vc (BK x Ev), which stay in L1 for the
  // block's panels.
  struct Block {
    const T *k, *v;
    index_t k_rs, v_rs;
  };
  struct Convert {
    T *kc, *vc;
  };
  // Whether rows of n elements, rs apart, are copied rather than read in place: half and int8
  // rows (converted), paged ones, and float rows a whole number of 4 KiB apart (K/V viewed as
  // (B, L, H, D) with H x D x 4 bytes a multiple of 4096, or sliced from a fused QKV projection):
  // in place, every such row falls into the same few L1 sets (a 4 KiB way), and the block's rows
  // evict each other between the passes over them. View over contiguous time, in place / copied
  // (AVX-512, in one process): causal H32 L1024 D128 1.05-1.17 / 0.98-1.00, H8 L2048 D128
  // 0.98-1.05 / 0.96, causal H16 L1024 D64 1.10-1.14 / 0.99; AVX2: 2.03 / 1.05, 1.16 / 1.06,
  // 1.22 / 1.08. Rows 2 KiB apart (H8 D64) lost 1-4% copied, and contiguous rows 0-3%: those stay
  // in place.
  static bool gathers_rows(const AttnArgs& args, index_t rs, index_t n) {
    return kHalf || args.block_table != nullptr || page_apart(rs, n);
  }
  static bool page_apart(index_t rs, index_t n) { return rs != n && (rs * index_t(sizeof(KV))) % 4096 == 0; }
  bool gathers() const { return gather_k || gather_v; }

  // Whether a prefill may copy float K/V rows, rs apart, into a contiguous copy of a problem's
  // rows that the thread keeps for its next tasks (held_elems, worth_holding; else as gathers_rows
  // says). K/V viewed as (B, L, H, D), packed varlen tokens or a fused QKV projection have rows
  // 1-4 KiB apart, a page or two each: the hardware prefetchers do not follow them across pages,
  // and their lines fill only the L2 sets of their page offsets, so a head's rows no longer stay
  // in L2 from one task to the next. Time over contiguous K/V (Xeon, 2 threads, B1 D64, one
  // process), in place / copied: AVX-512 H8 L2048 1.11-1.18 / 0.98, causal 1.10 / 1.00, H12
  // L1024 1.18 / 0.99, H8 L4096 1.15 / 1.01, 4 KiB apart (gathers_rows) H16 L2048 1.11 / 0.99;
  // AVX2 H8 L2048 1.10-1.13 / 0.97.
  static bool holds_rows(const AttnArgs& args, index_t rs, index_t n) {
    return !kHalf && args.block_table == nullptr && rs != n;
  }
  // Elements of a thread's copy: a problem's K and V rows, if that is at most 4 MiB (an L2's
  // size) and some problem may take it (worth_holding the call's longest query run); else
  // 0, and no copy.
  std::size_t held_elems() const {
    const index_t row = (hold_k ? a.E : 0) + (hold_v ? a.Ev : 0);
    if (row == 0 || a.Lk > index_t(4 << 20) / (row * index_t(sizeof(T))) || !worth_holding(a.Lq)) return 0;
    return std::size_t(a.Lk) * std::size_t(row);
  }
  // Whether the rows of a problem of Lq queries are worth the copy: rows of up to 256 bytes that
  // 384 queries or more read. Rows of 512 bytes were 1.02-1.05x slower in place than contiguous
  // and no faster copied (D128 L1024-2048). Copied over in place (time): with 256 readers L256
  // 1.02, causal L512 1.06; with 384-512, L384 1.01, L448 0.99, L512 1.00, causal L768 0.98,
  // causal L896 0.97 (and varlen's 8 causal sequences of 64-2048 tokens 0.97x the time holding
  // from 512); beyond, L768 0.95, causal L1536 0.94.
  bool worth_holding(index_t Lq) const {
    index_t reads = a.causal ? Lq / 2 : Lq;
    if (wl != kNoLimit) reads = min_of<index_t>(reads, wl + 1);
    return max_of<index_t>(hold_k ? a.E : 0, hold_v ? a.Ev : 0) * index_t(sizeof(T)) <= 256 && reads >= 384;
  }
  // A thread's copy: key j's rows at k + j * E and v + j * Ev (null where that operand is not
  // copied), keys [j0, j1) of the K / V rows at element offsets ko / vo (0 for an operand not
  // copied; kNone before the first copy); zero: a.bh zeros, the copy's row offsets.
  struct Held {
    static constexpr index_t kNone = std::numeric_limits<index_t>::min();
    T *k, *v;
    index_t* zero;
    index_t ko, vo, j0, j1;
  };
  // Keys [j0, j1) of problem p into the thread's copy, beside those it holds (or in their place).
  // Kept by the rows' offsets, not the problem: the query heads of a GQA group read the same
  // rows, and head-major tasks give a thread a group's heads one after another.
  PYATTN_NOINLINE void hold_rows(const Problem& p, index_t j0, index_t j1, Held& h) const {
    if (j0 >= j1) return;
    const index_t ko = hold_k ? a.koff[p.bh] : 0, vo = hold_v ? a.voff[p.bh] : 0;
    if (ko != h.ko || vo != h.vo || j0 > h.j1 || j1 < h.j0) h.ko = ko, h.vo = vo, h.j0 = h.j1 = j0;
    if (j0 < h.j0) copy_rows(p, j0, h.j0, h), h.j0 = j0;
    if (j1 > h.j1) copy_rows(p, h.j1, j1, h), h.j1 = j1;
  }
  //   h.k[j] = K[j], h.v[j] = V[j] for j in [j0, j1) (gather_rows), each chunk's rows asked for
  //   a chunk ahead (prefetches GCC dropped until 3bca3d5; since they run, chunked paged and
  //   float16 prefills measured 0.99-1.01 against the build without them)
  void copy_rows(const Problem& p, index_t j0, index_t j1, const Held& h) const {
    constexpr index_t C = 16;
    for (index_t j = j0; j < j1; j += C) {
      const index_t m = min_of<index_t>(C, j1 - j), n = min_of<index_t>(C, j1 - j - m);
      if (n > 0 && hold_k) prefetch_keys(p, j + m, n);
      if (n > 0 && hold_v) prefetch_values(p, j + m, n);
      if (hold_k) gather_rows(p, j, m, true, h.k + j * a.E);
      if (hold_v) gather_rows(p, j, m, false, h.v + j * a.Ev);
    }
  }
  void gather_rows(const Problem& p, index_t k0, index_t kb, bool keys, T* dst) const {
    const index_t n = keys ? a.E : a.Ev, rs = keys ? a.k_rs : a.v_rs;
    for (index_t j = k0, e = k0 + kb; j < e;) {
      const index_t m = min_of<index_t>(e - j, run(j));
      K::convert_rows(keys ? key_row(p, j) : value_row(p, j), rs, m, n, dst + (j - k0) * n, n);
      if constexpr (kInt8) {  // the run's scales are contiguous too, ks_rs / vs_rs apart
        const float* sc0 = keys ? a.k_scale + row_at(p, a.ksoff, a.ks_rs, a.ks_ps, j)
                                : a.v_scale + row_at(p, a.vsoff, a.vs_rs, a.vs_ps, j);
        const index_t srs = keys ? a.ks_rs : a.vs_rs;
        for (index_t r = 0; r < m; ++r) {
          const T sc = T(sc0[r * srs]);
          T* row = dst + (j - k0 + r) * n;
#pragma omp simd
          for (index_t x = 0; x < n; ++x) row[x] *= sc;
        }
      }
      j += m;
    }
  }
  Block key_block(const Problem& p, index_t k0, index_t kb, const Convert& cv) const {
    if constexpr (!kHalf)
      if (!gather_k) return Block{key + a.koff[p.bh] + k0 * a.k_rs, nullptr, a.k_rs, 0};
    gather_rows(p, k0, kb, true, cv.kc);
    return Block{cv.kc, nullptr, a.E, 0};
  }
  Block value_block(const Problem& p, index_t k0, index_t kb, const Convert& cv) const {
    if constexpr (!kHalf)
      if (!gather_v) return Block{nullptr, value + a.voff[p.bh] + k0 * a.v_rs, 0, a.v_rs};
    gather_rows(p, k0, kb, false, cv.vc);
    return Block{nullptr, cv.vc, 0, a.Ev};
  }

  // The score variants on rows [j, j+mr) of a panel's raw S^T (queries from qp, keys from k0).
  template <bool CAP, bool ALIBI>
  void mod_rows(const Problem& p, index_t qp, index_t k0, index_t j, int mr, Tile& t) const {
    if constexpr (CAP || ALIBI) {
      const T base = T(qp + p.off - (k0 + j));
      for (int r = 0; r < mr; ++r) K::template mod_span<CAP, ALIBI>(t.st + (j + r) * NR, NR, p.md, base - T(r), T(1));
    }
  }

  // Rows [j, j+mr) of one panel's S^T block (queries from qp): fused into exp2, or raw then
  // modified.
  template <bool CAP, bool ALIBI>
  PYATTN_ALWAYS_INLINE void score_tile(const Problem& p, index_t qp, index_t k0, index_t j, int mr, const Block& blk,
                                       Tile& ti, bool fused) const {
    if (fused) {
      K::template ukernel_exp2<CAP, ALIBI>(mr, a.E, blk.k + j * blk.k_rs, blk.k_rs, 1, ti.qt, NR, ti.st + j * NR, NR,
                                           ti.nr, ti.sub, ti.cmax, ti.csum, p.md, T(qp + p.off - (k0 + j)));
    } else {
      // columns before c0 cannot see key k0 + j, nor the later keys of these rows:
      // mask_edges sets all of them to -inf, so they are not computed
      const int c0 = hidden_vectors(p, qp, k0 + j, ti.nr);
      if (c0 < ti.nr)
        K::ukernel(mr, a.E, blk.k + j * blk.k_rs, blk.k_rs, 1, ti.qt + c0, NR, ti.st + j * NR + c0, NR, ti.nr - c0,
                   false);
      mod_rows<CAP, ALIBI>(p, qp, k0, j, mr, ti);
    }
  }

  // S^T blocks of np query panels = mods(K[k0:k0+kb] Q^T), in the kernel set's order
  // (panel_outer_scores); then masked. Panels with fused[p] get P^T = exp2(S^T - sub) straight
  // from the kernel, with colmax(S^T - sub) in cmax and colsum(P^T) in csum (only for unmasked
  // blocks). With `prime` (an unmasked block), a fresh panel takes its references from its first
  // eight keys and the fused path for the rest, fused[p] then set.
  template <bool CAP, bool ALIBI>
  PYATTN_PHASE void scores(const Problem& p, index_t q0, index_t k0, index_t kb, const Block& blk, Tile* t, int np,
                           bool* fused, bool prime) const {
    index_t first[kMaxNP] = {};  // rows of S^T already computed, per panel
    for (int i = 0; i < np; ++i) {
      if (fused && fused[i])
        for (int c = 0; c < NR; ++c) {
          t[i].cmax[c] = -kInf;
          t[i].csum[c] = T(0);
        }
      if (prime && fused && !fused[i] && t[i].fresh) {
        const int mr = int(min_of<index_t>(MR, kb));
        K::ukernel(mr, a.E, blk.k, blk.k_rs, 1, t[i].qt, NR, t[i].st, NR, t[i].nr, false);
        mod_rows<CAP, ALIBI>(p, q0 + i * NR, k0, 0, mr, t[i]);
        if constexpr (ALIBI) alibi_reference(p, q0 + i * NR, k0, mr, t[i]);
        fused[i] = prime_panel(mr, t[i], ALIBI);
        first[i] = MR;
      }
    }
    if constexpr (panel_outer_scores<K>::value) {
      for (int i = 0; i < np; ++i)
        for (index_t j = 0; j < kb; j += MR) {
          const int mr = int(min_of<index_t>(MR, kb - j));
          if (j >= first[i]) score_tile<CAP, ALIBI>(p, q0 + i * NR, k0, j, mr, blk, t[i], fused && fused[i]);
        }
    } else {
      for (index_t j = 0; j < kb; j += MR) {
        const int mr = int(min_of<index_t>(MR, kb - j));
        for (int i = 0; i < np; ++i)
          if (j >= first[i]) score_tile<CAP, ALIBI>(p, q0 + i * NR, k0, j, mr, blk, t[i], fused && fused[i]);
      }
    }
    const index_t qz = min_of<index_t>(p.Lq, q0 + index_t(np) * NR) - 1;
    if (unmasked(p, q0, qz, k0, kb)) return;
    for (int i = 0; i < np; ++i) {
      const index_t qp = q0 + i * NR, qc = min_of<index_t>(NR, p.Lq - qp);
      mask_edges(p, qp, qc, k0, kb, t[i].st);
      if (a.mask_kind != MaskKind::none)
        for (index_t c = 0; c < qc; ++c) {  // on the keys each query sees by position only
          const auto [jl, jh] = seen(p, qp + c, k0, kb);
          if (jh > jl) apply_mask(p, qp + c, k0 + jl, jh - jl, t[i].st + jl * NR + c, NR);
        }
    }
  }

  // mask_row's position edges for a panel's qc queries from qp, a key row at a time: query qi
  // sees key k < Lk iff qi + off - wl <= k < qi + off + wr + 1 (lo and hi unclamped), so the
  // queries that see key k are the columns [a, b) with a = k - off - wr - qp and
  // b = k - off + wl - qp + 1 (each clamped to [0, qc]); the rest of the row is set to -inf in
  // runs (by column, the same stores strided by NR were a twentieth of a 32-token prefill).
  //   st[j, c] = -inf for c < a_j or b_j <= c < qc
  void mask_edges(const Problem& p, index_t qp, index_t qc, index_t k0, index_t kb, T* st) const {
    auto clamp = [qc](index_t x) { return min_of<index_t>(qc, max_of<index_t>(0, x)); };
    for (index_t j = 0; j < kb; ++j) {
      const index_t k = k0 + j, ca = clamp(k - p.off - wr - qp),
                    cb = max_of<index_t>(ca, clamp(k - p.off + wl - qp + 1));
      T* row = st + j * NR;
      for (index_t c = 0; c < ca; ++c) row[c] = -kInf;
      for (index_t c = cb; c < qc; ++c) row[c] = -kInf;
    }
  }

  // The leading columns of a panel (queries from qp, nr of them), in whole vectors, whose right
  // edge (causal, window, kv_lens) lies at or before key kj: they see no key from kj on. Only a
  // masked block has any (an unmasked one is inside every query's edges), so mask_edges follows.
  int hidden_vectors(const Problem& p, index_t qp, index_t kj, int nr) const {
    int c = 0;
    while (c + VL <= nr && hi(p, qp + c + VL - 1) <= kj) c += VL;
    return c;
  }

  //   cm[c] = max over rows j < rows of st[j*NR + c] (-inf for no rows; NaN is skipped)
  static void colmax(const T* st, index_t rows, T* cm) {
    for (int c = 0; c < NR; ++c) cm[c] = -kInf;
    for (index_t j = 0; j < rows; ++j) {
      const T* s = st + j * NR;
#pragma omp simd
      for (int c = 0; c < NR; ++c) cm[c] = s[c] > cm[c] ? s[c] : cm[c];
    }
  }

  // With ALiBi, a fresh panel's first keys can lie far below the rest of its block (the bias
  // rises towards the diagonal): its reference is the raw scores' max over those keys plus the
  // block's largest bias (bhw, set by anticipate_bias), so that the fused kernel sees only the
  // raw scores' spread over the rest of the block.
  //   cmax[c] = max_{r < mr} (st[r, c] - bias[r, c]) + bhw[c]
  void alibi_reference(const Problem& p, index_t qp, index_t k0, int mr, Tile& t) const {
    const T base = T(qp + p.off - k0), ns = p.md.nslope;
    T* cm = t.cmax;
    for (int c = 0; c < NR; ++c) cm[c] = -kInf;
    for (int r = 0; r < mr; ++r) {
      const T* s = t.st + r * NR;
#pragma omp simd
      for (int c = 0; c < NR; ++c) {
        const T d = base + T(c - r), raw = s[c] - ns * (d < 0 ? -d : d);
        cm[c] = raw > cm[c] ? raw : cm[c];
      }
    }
#pragma omp simd
    for (int c = 0; c < NR; ++c) cm[c] += t.bhw[c];
  }

  // A fresh panel's references from the first mr rows of its first unmasked block (or from
  // cmax, when the caller has put one there):
  //   m = sub = colmax(st[0:mr]); st[0:mr] = exp2(st[0:mr] - m); csum = colsum; cmax = 0
  // Only where every column's max is finite (no -inf/NaN scores); else the block stays raw for
  // the two-pass update. A later key that beats m by the slack sends the block there too.
  static bool prime_panel(int mr, Tile& t, bool have_reference) {
    T* cm = t.cmax;
    colmax(t.st, mr, t.top);
    if (!have_reference)
      for (int c = 0; c < NR; ++c) cm[c] = t.top[c];
    bool finite = true;
    for (int c = 0; c < NR; ++c) finite &= cm[c] > -kInf && cm[c] < kInf;
    if (!finite) return false;
    for (int c = 0; c < NR; ++c) {
      t.m[c] = t.sub[c] = cm[c];
      // the fused kernel goes on with the max of S^T - sub (these rows' is 0, or below with ALiBi)
      t.cmax[c] = have_reference ? -kInf : T(0);
      t.csum[c] = T(0);
    }
    t.ready = true;
    for (int j = 0; j < mr; ++j) K::exp2_sub_cols(t.st + j * NR, t.sub, t.csum, NR);
    return true;
  }

  // Two-pass block update, for masked blocks and panels whose references are not all set:
  //   m' = colmax(st) where it exceeds m + kSlack, else m; alpha = exp2(m - m') (1 where m was
  //   -inf: l and acc are still 0); sub = m' or 0 if m' = -inf;
  //   st = exp2(st - sub); l = alpha*l + colsum(st); acc^T *= alpha where m moved
  // Returns the block's largest P, log2 (colmax less sub; accumulate's far blocks).
  PYATTN_PHASE T online_softmax(index_t kb, Tile& t) const {
    T* cm = t.cmax;
    colmax(t.st, kb, cm);
    for (int c = 0; c < NR; ++c) t.top[c] = cm[c] > t.top[c] ? cm[c] : t.top[c];
    lower_reference(t);
    bool moved = false, ready = true;
    for (int c = 0; c < NR; ++c) {
      T al = T(1);
      if (cm[c] > t.m[c] + kSlack) {
        if (t.m[c] != -kInf) al = exp2_floored(T(t.m[c] - cm[c]));
        t.m[c] = cm[c];
      }
      t.alpha[c] = al;
      moved |= al != T(1);
      ready &= t.m[c] != -kInf;
      t.sub[c] = t.m[c] == -kInf ? T(0) : t.m[c];
      t.csum[c] = T(0);
    }
    t.ready = ready;
    T peak = -kInf;
    for (int c = 0; c < NR; ++c) peak = cm[c] - t.sub[c] > peak ? cm[c] - t.sub[c] : peak;
    for (index_t j = 0; j < kb; ++j) K::exp2_sub_cols(t.st + j * NR, t.sub, t.csum, NR);
#pragma omp simd
    for (int c = 0; c < NR; ++c) t.l[c] = t.alpha[c] * t.l[c] + t.csum[c];
    if (moved) scale_acc(t, t.alpha);
    return peak;
  }

  // ALiBi's reference for a block (its first keys' raw maximum plus the block's largest bias, or
  // raised by anticipate_bias) can lie far above every score a query has seen, and exp2 gives 0
  // more than 126 binades under it (common.h, kExp2Floor): a key 80 natural units above the rest
  // at slope 0.5 lost whole rows that way. Where the reference exceeds the largest score taken in
  // (top) by over kUnder, it moves down by the whole binades d = floor(m - top) and l and acc scale
  // up by 2^d, exactly; the caller then takes the block the two-pass way against it. Without
  // ALiBi the reference never exceeds top by more than 1.
  //   where m - top > kUnder: d = floor(m - top); m = sub = m - d; l *= 2^d; acc^T *= 2^d
  static constexpr T kUnder = T(64);
  void lower_reference(Tile& t) const {
    T* d = t.inv;  // free until the panel is finished
    bool any = false;
    for (int c = 0; c < NR; ++c) {
      d[c] = T(0);
      if (t.m[c] - t.top[c] > kUnder && t.top[c] > -kInf && t.m[c] < kInf) {
        d[c] = std::floor(t.m[c] - t.top[c]);
        t.m[c] = t.sub[c] = t.m[c] - d[c];
        any = true;
      }
    }
    if (!any) return;
    // by 2^d in steps of at most 2^64, each a finite power of two
    for (bool more = true; more;) {
      more = false;
      for (int c = 0; c < NR; ++c) {
        const T step = d[c] < T(64) ? d[c] : T(64);
        d[c] -= step;
        more |= d[c] > T(0);
        t.alpha[c] = exp2_whole(step);
        t.l[c] *= t.alpha[c];
      }
      scale_acc(t, t.alpha);
    }
  }

  // After a fused block: l += csum. Where a score exceeded its query's reference by over kSlack
  // but not by kRescaleMax, P = exp2(S - sub) is kept: the reference moves up by d = ceil(cmax),
  // and the column's P, csum, l and acc are scaled by 2^-d in place, exactly (a power of two).
  // Only past kRescaleMax is the block recomputed and taken the two-pass way: S - sub is rounded
  // to the float spacing at its size, so a far stale reference costs accuracy (16: below an ulp
  // of P at 1e-6 for float; 96 gave 4x the two-pass error under a steep ALiBi).
  static constexpr T kRescaleMax = T(sizeof(T) == 4 ? 16 : 960);
  template <bool CAP, bool ALIBI>
  PYATTN_PHASE T finish_fused(const Problem& p, index_t qp, index_t k0, index_t kb, const Block& blk, Tile& t) const {
    bool over = false, overflow = false, under = false;
    T peak = -kInf;
    for (int c = 0; c < NR; ++c) {
      peak = t.cmax[c] > peak ? t.cmax[c] : peak;
      over |= t.cmax[c] > kSlack;
      overflow |= t.cmax[c] > kRescaleMax;
      const T top = t.cmax[c] + t.sub[c];
      t.top[c] = top > t.top[c] ? top : t.top[c];
      under |= ALIBI && t.m[c] - t.top[c] > kUnder;  // small weights went under the floor
    }
    if (overflow || under) {  // redo the block two-pass (online_softmax lowers a far reference)
      scores<CAP, ALIBI>(p, qp, k0, kb, blk, &t, 1, nullptr, false);
      return online_softmax(kb, t);
    }
    if (over) {
      for (int c = 0; c < NR; ++c) {
        T f = T(1);
        if (t.cmax[c] > kSlack) {
          const T d = std::ceil(t.cmax[c]);
          f = exp2_whole(-d);
          t.m[c] = t.sub[c] = t.sub[c] + d;
        }
        t.alpha[c] = f;
      }
      for (index_t j = 0; j < kb; ++j) {
        T* s = t.st + j * NR;
#pragma omp simd
        for (int c = 0; c < NR; ++c) s[c] *= t.alpha[c];
      }
#pragma omp simd
      for (int c = 0; c < NR; ++c) {
        t.csum[c] *= t.alpha[c];
        t.l[c] *= t.alpha[c];
      }
      scale_acc(t, t.alpha);
    }
#pragma omp simd
    for (int c = 0; c < NR; ++c) t.l[c] += t.csum[c];
    return peak;  // (where over, above kSlack: never far)
  }

  // acc^T += V_blk^T P^T for every panel, eight value columns at a time across the panels.
  // far[i] (ALiBi; nullptr: none): panel i's block has all its weights under 2^-kFar (its
  // largest P, as finish_fused and online_softmax return it), so the micro-kernel's registers
  // start from acc (see gemm_ukernel_from_c). Each product then rounds at
  // acc's scale: for weights under 2^-40 the block's whole share is below 2^-33 of acc, but
  // every block taken that way cost float32 ALiBi attention 2.3x the error of the sums from zero
  // (B1 H2 L4096 D64, non-causal: 2.0e-6 against 8.6e-7, plain 8.3e-7), so only those blocks do.
  static constexpr T kFar = T(sizeof(T) == 4 ? 40 : 80);
  PYATTN_PHASE void accumulate(const Problem& p, index_t q0, index_t k0, index_t kb, const Block& blk, Tile* t, int np,
                               index_t kn, index_t nnext, const bool* far) const {
    // The next block's K rows ([kn, kn + nnext)), spread over the value-column steps.
    const index_t per = ceil_div(nnext, max_of<index_t>(1, ceil_div(a.Ev, MR)));
    // Keys hidden by position are never part of an output, not even as 0 * NaN: a value row that
    // some of the panels' queries cannot see (before the last one's left edge, from the first
    // one's right edge on) and that is not finite sends the block to pv_exact.
    const index_t qz = min_of<index_t>(p.Lq, q0 + index_t(np) * NR) - 1;
    const bool exact = !edge_values_finite(p, q0, qz, k0, kb, blk.v, blk.v_rs);
    // On the last block, when the panels taking it have few output rows, those rows instead, for
    // writing: finish_panel stores them next, and its stores otherwise wait on every line (more
    // rows would push the tiles out of L1: finish_panel asks for those one panel at a time).
    const bool small = std::size_t(qz + 1 - q0) * std::size_t(a.Ev) * sizeof(T) <= (16u << 10);
    const index_t nout = nnext || !small ? 0 : qz + 1 - q0,
                  oper = ceil_div(nout, max_of<index_t>(1, ceil_div(a.Ev, MR)));
    T* o = out + a.ooff[p.bh] + q0 * a.o_rs;
    for (index_t d = 0, r = 0; d < a.Ev; d += MR, r += per) {
      const int mr = int(min_of<index_t>(MR, a.Ev - d));
      if (r < nnext) prefetch_keys(p, kn + r, min_of<index_t>(per, nnext - r));
      const index_t ro = (d / MR) * oper;
      if (ro < nout) prefetch_rows<true>(o + ro * a.o_rs, a.o_rs, min_of<index_t>(oper, nout - ro), a.Ev);
      for (int i = 0; i < np; ++i) {
        if (exact)
          pv_exact(p, q0 + i * NR, k0, kb, blk.v + d, blk.v_rs, mr, t[i], d);
        else if (far && far[i])
          from_c_ukernel<K>::call(mr, kb, blk.v + d, index_t(1), blk.v_rs, t[i].st, index_t(NR), t[i].acc + d * NR,
                                  index_t(NR), t[i].nr, !t[i].fresh);
        else
          K::ukernel(mr, kb, blk.v + d, 1, blk.v_rs, t[i].st, NR, t[i].acc + d * NR, NR, t[i].nr, !t[i].fresh);
      }
    }
    for (int i = 0; i < np; ++i) t[i].fresh = false;
  }

  // Whether the n elements of rows [r0, r1) are all finite, in the storage type: NaN and inf have
  // every exponent bit set in float16 and bfloat16; an int8 row is as finite as its scale
  // (scales[r]: a NaN or inf written into the cache is kept as a NaN scale).
  static bool finite_kv_rows(const KV* const* rows, const T* scales, index_t r0, index_t r1, index_t n) {
    if constexpr (kInt8) {
      return finite_rows(scales + r0, 1, 1, r1 - r0);
    } else if constexpr (kHalf) {
      (void)scales;
      const std::uint16_t e = std::is_same<KV, f16_t>::value ? 0x7c00u : 0x7f80u;
      std::uint16_t bad = 0;
      for (index_t r = r0; r < r1; ++r)
        for (index_t c = 0; c < n; ++c) bad |= std::uint16_t((rows[r][c].bits & e) == e);
      return bad == 0;
    } else {
      (void)scales;
      for (index_t r = r0; r < r1; ++r)
        if (!finite_rows(rows[r], 0, 1, n)) return false;
      return true;
    }
  }

  // Whether rows [0, rows) of n elements, rs apart, are all finite: the largest exponent field
  // (an unsigned max, which does not wait on the previous step as a float sum does; that sum cost
  // a 32-token prefill 8%) is below all ones (inf and NaN).
  static bool finite_rows(const T* x, index_t rs, index_t rows, index_t n) {
    using U = typename std::conditional<sizeof(T) == 4, std::uint32_t, std::uint64_t>::type;
    constexpr U kExp = sizeof(T) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull);
    U top = 0;
    if (rs == n) {  // one run: no per-row reduction of the vector
      n *= rows;
      rows = 1;
    }
    for (index_t r = 0; r < rows; ++r) {
      const T* xr = x + r * rs;
#pragma omp simd reduction(max : top)
      for (index_t c = 0; c < n; ++c) {
        U u;
        std::memcpy(&u, xr + c, sizeof(U));
        const U e = u & kExp;
        top = e > top ? e : top;
      }
    }
    return top != kExp;
  }

  // acc^T[d:d+mr] (+)= V_blk^T[d:d+mr] P^T where a value row is not finite: each query takes
  // exactly the keys it sees, one product at a time (rare: NaN or inf where an edge crosses).
  void pv_exact(const Problem& p, index_t qp, index_t k0, index_t kb, const T* v, index_t v_rs, int mr, Tile& t,
                index_t d) const {
    T* acc = t.acc + d * NR;
    if (t.fresh)
      for (int x = 0; x < mr; ++x)
        for (int c = 0; c < t.nr; ++c) acc[x * NR + c] = T(0);
    for (int c = 0; c < t.nr; ++c) {
      const auto [j0, j1] = seen(p, qp + c, k0, kb);
      for (index_t j = j0; j < j1; ++j) {
        const T w = t.st[j * NR + c];
        for (int x = 0; x < mr; ++x) acc[x * NR + c] += w * v[j * v_rs + x];
      }
    }
  }

  // ALiBi makes scores rise by up to |slope| * kb * log2(e) from one key block to the next
  // (towards the diagonal; away from it for a negative slope), far past the lazy reference's
  // slack. The bias is known before the block is computed: its largest value for query i over
  // the keys of [k0, k0+kb) it may see by position (causal, window, kv_lens) is nslope * dist,
  // the distance to the nearest of them (the farthest for a negative slope). Where that exceeds
  // what earlier blocks reached, the reference of a ready column moves up by the difference
  // (rounded up to an integer, so l and acc scale exactly by 2^-d) before the fused kernel runs,
  // which then sees only the spread of the raw scores. The bound must be reached by a visible
  // key: one too high would leave every visible score far below the reference (underflow), so
  // it is not taken with a mask (which may hide any key; the caller skips this then).
  // A rise that would put the reference more than kRiseMax above the best score taken in (top) is
  // not taken ahead: scaling l and acc by 2^-d would leave nothing of the earlier keys if the
  // block's raw scores fell by as much (a key far above the rest early in the row), and the fused
  // kernel could not tell. The block goes the two-pass way instead, which takes its reference
  // from the scores it finds.
  void anticipate_bias(const Problem& p, index_t qp, index_t k0, index_t kb, Tile& t) const {
    bool moved = false, steep = false;
    // whether every query of the panel sees the whole block (lo and hi rise with the query)
    const index_t qz = min_of<index_t>(p.Lq, qp + NR) - 1;
    const bool whole = lo(p, qz) <= k0 && hi(p, qp) >= k0 + kb;
    for (int c = 0; c < NR; ++c) {
      const index_t qi = qp + c, i = qi + p.off;
      index_t j0 = k0, j1 = k0 + kb - 1;
      if (!whole) {
        j0 = max_of<index_t>(k0, lo(p, qi));
        j1 = min_of<index_t>(k0 + kb, hi(p, qi)) - 1;
        if (qi >= p.Lq || j0 > j1) {  // sees none of the block
          t.alpha[c] = T(1);
          continue;
        }
      }
      const index_t near = i < j0 ? j0 - i : i > j1 ? i - j1 : 0;
      const index_t far = max_of<index_t>(i > j0 ? i - j0 : j0 - i, i > j1 ? i - j1 : j1 - i);
      const T b = p.md.nslope * T(p.md.nslope > T(0) ? far : near);
      T f = T(1);
      if (t.ready && b > t.bhw[c] && t.bhw[c] > -kInf) {
        const T d = std::ceil(b - t.bhw[c]);
        if (d + (t.m[c] - t.top[c]) > kRiseMax) {  // the earlier keys' best would fall that far
          steep = true;
        } else {
          f = exp2_whole(-d);
          t.m[c] = t.sub[c] = t.sub[c] + d;
        }
      }
      t.bhw[c] = b > t.bhw[c] ? b : t.bhw[c];
      t.alpha[c] = f;
      moved |= f != T(1);
    }
    if (steep) t.ready = false;  // this block the two-pass way
    if (!moved) return;
#pragma omp simd
    for (int c = 0; c < NR; ++c) t.l[c] *= t.alpha[c];
    scale_acc(t, t.alpha);
  }

  // First query of panel i and last query of panel i of a group starting at q0.
  index_t first_q(index_t q0, int i) const { return q0 + index_t(i) * NR; }
  index_t last_q(const Problem& p, index_t q0, int i) const {
    return min_of<index_t>(p.Lq, q0 + index_t(i + 1) * NR) - 1;
  }
  // The group at q0 of up to np panels: the panels that hold queries, and the keys [beg, end)
  // its queries see (all that query_group reads, and so all that take_group copies). query_group
  // spells the same two lines out: through this struct its loop ran 1.2% slower (AVX-512, causal
  // H32 L1024 D128, 30 rounds), the panel loop's sensitivity to its surroundings.
  struct GroupSpan {
    int np;
    index_t beg, end;
  };
  GroupSpan group_span(const Problem& p, index_t q0, int np) const {
    np = int(min_of<index_t>(np, ceil_div(p.Lq - q0, NR)));
    return GroupSpan{np, lo(p, q0), hi(p, last_q(p, q0, np - 1))};
  }

  // Whether problem p's key blocks are visited outward from each task's queries (query_group):
  // ALiBi of a positive slope, whose bias peaks at a query's own key and falls away from it.
  static bool outward(const Problem& p) { return p.md.nslope < T(0); }

  // Queries [q0, q0 + np*NR) of problem p: np panels of NR queries share each K/V block. The
  // keys [kbeg, kend) that any of them sees are visited in blocks; the panels that see part of
  // a block, [p0, p1), take it: a panel leaves once past its last key (causal, window right) and
  // joins at its first (window left). A block is cut where the first active panel's keys end,
  // so that it computes no row of keys it cannot see.
  // Under a positive ALiBi slope (outward) the block at c, the first query's own key, comes first,
  // then the keys before it, then the rest after it, each range ascending (c = kbeg otherwise: one
  // range). Once a panel has taken the keys nearest its queries, a later block lowers its scores
  // and the lazy reference holds without a rescale of l and acc; from kbeg up, the reference rose
  // with every block (anticipate_bias rescaled l and acc each time, in blocks cut short for steep
  // slopes: ALiBi took 1.10x the plain time at B1 H8 L2048 D64, non-causal). Ranges, not blocks
  // from c outward in both directions: K and V are read in ascending runs either way, and blocks
  // taken in descending order were no faster. The weights of keys far from a query then lie
  // near 2^-126, hence accumulate's far blocks.
  template <bool CAP, bool ALIBI>
  void query_group(const Problem& p, index_t q0, int np, Tile* t, const Convert& cv) const {
    if (q0 >= p.Lq) return;  // a shorter sequence of a varlen batch: no such queries
    np = int(min_of<index_t>(np, ceil_div(p.Lq - q0, NR)));
    const index_t kbeg = lo(p, q0), kend = hi(p, last_q(p, q0, np - 1));  // as group_span
    const index_t c = ALIBI && outward(p) ? max_of<index_t>(kbeg, min_of<index_t>(kend, q0 + p.off)) : kbeg;
    // The task's Q rows and first K block are asked for together before the Q^T packing starts
    // on them: on short sequences these first touches were a sixth of the time. (That was
    // measured with the Q rows' prefetch alone: GCC dropped prefetch_keys until 3bca3d5.)
    const index_t nq = min_of<index_t>(p.Lq - q0, index_t(np) * NR);
    prefetch_rows(query + a.qoff[p.bh] + q0 * a.q_rs, a.q_rs, nq, a.E);
    if (kend > c)
      prefetch_keys(p, c, min_of<index_t>(p.bk, kend - c));
    else if (c > kbeg)
      prefetch_keys(p, kbeg, min_of<index_t>(p.bk, c - kbeg));
    for (int i = 0; i < np; ++i) {
      const index_t qp = first_q(q0, i), qc = min_of<index_t>(NR, p.Lq - qp);
      pack_qt(query + a.qoff[p.bh] + qp * a.q_rs, qc, t[i].qt);
      // A short panel: the kernels skip its unused vectors, so give those columns of st a
      // finite filler once (the column statistics run over all NR columns), over BK rows:
      // weights_panel takes the same tiles in blocks of BK.
      t[i].nr = int(qc);
      if (qc < NR)
        for (index_t j = 0, rows = min_of<index_t>(BK, kend - kbeg); j < rows; ++j)
          for (index_t c = qc; c < NR; ++c) t[i].st[j * NR + c] = T(0);
      reset_panel(t[i]);
    }
    // Panels [p0, p1) take keys [k0, k0 + kb); kn is the next block's first key (for prefetching,
    // as are its at most bk keys), nn = 0 on the last block.
    auto take = [&](index_t k0, index_t kb, int p0, int p1, index_t kn, index_t nn) {
      const index_t qa = first_q(q0, p0);
      Tile* ta = t + p0;
      const int na = p1 - p0;
      const bool plain = unmasked(p, qa, last_q(p, q0, p1 - 1), k0, kb);
      const Block kblk = key_block(p, k0, kb, cv);
      if constexpr (ALIBI)
        if (a.mask_kind == MaskKind::none)
          for (int i = 0; i < na; ++i) anticipate_bias(p, qa + i * NR, k0, kb, ta[i]);
      bool fused[kMaxNP];
      for (int i = 0; i < na; ++i) fused[i] = plain && ta[i].ready;
      scores<CAP, ALIBI>(p, qa, k0, kb, kblk, ta, na, fused, plain);
      bool far[kMaxNP];
      for (int i = 0; i < na; ++i) {
        const T peak =
            fused[i] ? finish_fused<CAP, ALIBI>(p, qa + i * NR, k0, kb, kblk, ta[i]) : online_softmax(kb, ta[i]);
        far[i] = peak < -kFar;
      }
      accumulate(p, qa, k0, kb, value_block(p, k0, kb, cv), ta, na, kn, nn, ALIBI ? far : nullptr);
    };
    // The block at k0 of a range ending at e: its length (cut where panel p0's keys end), and the
    // panels [p0, p1) that take it.
    auto block_at = [&](index_t k0, index_t e, int& p0, int& p1) {
      while (p0 < np - 1 && hi(p, last_q(p, q0, p0)) <= k0) ++p0;
      index_t kb = min_of<index_t>(p.bk, e - k0);
      if (p0 < np - 1) kb = min_of<index_t>(kb, max_of<index_t>(MR, hi(p, last_q(p, q0, p0)) - k0));
      p1 = p0 + 1;
      while (p1 < np && lo(p, first_q(q0, p1)) < k0 + kb) ++p1;
      return kb;
    };
    // Ranges [beg, end) taken in order, each ascending: the block at c, the keys before it, the
    // keys after it (c = kbeg: all of them in the first range).
    int p0 = 0, p1 = 0;
    const index_t d = c < kend ? c + block_at(c, kend, p0, p1) : c;
    const index_t range[3][2] = {{c, c > kbeg ? d : kend}, {kbeg, c}, {c > kbeg ? d : kend, kend}};
    for (int r = 0; r < 3; ++r) {
      p0 = 0;
      for (index_t k0 = range[r][0], e = range[r][1], kb = 0; k0 < e; k0 += kb) {
        kb = block_at(k0, e, p0, p1);
        // the next block's keys, for prefetching: on in this range, or the next range's first
        index_t kn = k0 + kb, nn = min_of<index_t>(p.bk, e - kn);
        for (int n = r + 1; nn == 0 && n < 3; ++n) kn = range[n][0], nn = min_of<index_t>(p.bk, range[n][1] - kn);
        take(k0, kb, p0, p1, kn, nn);
      }
    }
    for (int i = 0; i < np; ++i) finish_panel<CAP, ALIBI>(p, first_q(q0, i), t[i], cv);
  }

  // 1 / l; 0 where no key was visible (l = 0); NaN where l is NaN (a NaN or inf score), so that
  // the weights are NaN wherever the output is, as in the reference.
  static T inv_of(T l) { return l > T(0) ? T(1) / l : l == T(0) ? T(0) : l; }

  // A row's statistics once its keys are all in: the sink (if any) joins the sum, as one more
  // logit with no value. l is relative to sub; returns the total, still relative to sub. The
  // sink's term is floored as every weight is (exp2_floored, as the prefill's exp2_sub_cols): a
  // row that saw no key (l = 0) would otherwise take 1 / subnormal = inf, and 0 * inf is NaN.
  T with_sink(const Problem& p, T sub, T l) const {
    if (!sinks) return l;
    return l + exp2_floored(T(sinks[p.bh] * T(kLog2e) - sub));
  }

  // The natural-log LSE of a row: ln 2 * (sub + log2(l)), with the sink's logit included; -inf
  // for a row that saw no key and has no sink, the sink for one that has.
  T lse_of(const Problem& p, T sub, T l) const {
    if (l != l) return l;  // NaN
    if (!sinks) return l > T(0) ? T(kLn2) * (sub + std::log2(l)) : -kInf;
    const T s = sinks[p.bh] * T(kLog2e);
    if (!(l > T(0)) || s == kInf) return T(kLn2) * s;  // a +inf sink outweighs every key
    const T M = sub > s ? sub : s;                     // both exponents below are <= 0
    return T(kLn2) * (M + std::log2(l * T(std::exp2(sub - M)) + T(std::exp2(s - M))));
  }

  // out = acc / l (zeros where no key was visible), lse; the weights if asked.
  template <bool CAP, bool ALIBI>
  PYATTN_PHASE void finish_panel(const Problem& p, index_t q0, Tile& t, const Convert& cv) const {
    const index_t qc = min_of<index_t>(NR, p.Lq - q0);
    T* o = out + a.ooff[p.bh] + q0 * a.o_rs;
    // with_sink in vector lanes (cmax and csum are free by now): a scalar exp2 per query was 3%
    // of a short sequence's call
    if (sinks) {
      const T s = sinks[p.bh] * T(kLog2e);
      for (int c = 0; c < NR; ++c) {
        t.cmax[c] = s;
        t.csum[c] = t.l[c];
      }
      K::exp2_sub_cols(t.cmax, t.sub, t.csum, NR);  // csum = l + exp2(s - sub)
      for (int c = 0; c < NR; ++c) t.inv[c] = inv_of(t.csum[c]);
    } else {
      for (int c = 0; c < NR; ++c) t.inv[c] = inv_of(t.l[c]);
    }
    // The rows the transpose below stores to (accumulate may have asked for them already)
    prefetch_rows<true>(o, a.o_rs, qc, a.Ev);
    if (t.fresh)  // no key block was taken in
      for (index_t x = 0; x < a.Ev * NR; ++x) t.acc[x] = T(0);
    K::transpose(t.acc, NR, a.Ev, qc, o, a.o_rs, ColumnScale<T>{t.inv});  // out = acc / l
    if (lse)
      for (index_t c = 0; c < qc; ++c) lse[a.lseoff[p.bh] + (q0 + c) * a.lse_s] = lse_of(p, t.sub[c], t.l[c]);
    if (weights) weights_panel<CAP, ALIBI>(p, q0, qc, t, cv);
  }

  // Second sweep for return_weights: W[q, j] = exp2(S^T[j, q] - sub_q) * inv_q over the panel's
  // keys, written exactly once (the rest stays the caller's zeros).
  template <bool CAP, bool ALIBI>
  PYATTN_PHASE void weights_panel(const Problem& p, index_t q0, index_t qc, Tile& t, const Convert& cv) const {
    T* w = weights + a.woff[p.bh] + q0 * a.w_rs;
    const index_t kbeg = lo(p, q0), kend = hi(p, q0 + qc - 1);
    for (index_t k0 = kbeg; k0 < kend; k0 += BK) {
      const index_t kb = min_of<index_t>(BK, kend - k0);
      scores<CAP, ALIBI>(p, q0, k0, kb, key_block(p, k0, kb, cv), &t, 1, nullptr, false);
      for (index_t j = 0; j < kb; ++j)
        K::exp2_sub_cols(t.st + j * NR, t.sub, t.csum, NR);  // l is final: csum not needed
      for (index_t c = 0; c < qc; ++c) {
        T* wr = w + c * a.w_rs + k0;
        for (index_t j = 0; j < kb; ++j) wr[j] = t.st[j * NR + c] * t.inv[c];
      }
    }
    for (index_t c = 0; c < qc; ++c) nan_weights_row(t.inv[c], w + c * a.w_rs);
  }

  // Whether the value rows of keys [k0, k0 + kb) (v, rows v_rs apart) that some of the queries
  // qa..qz see by position and others do not (before qz's left edge, from qa's right edge on)
  // are all finite: where one is not, each query must take exactly the rows it sees (0 * inf).
  bool edge_values_finite(const Problem& p, index_t qa, index_t qz, index_t k0, index_t kb, const T* v,
                          index_t v_rs) const {
    const index_t rl = seen(p, qz, k0, kb).first, rh = max_of<index_t>(rl, seen(p, qa, k0, kb).second);
    return finite_rows(v, v_rs, rl, a.Ev) && finite_rows(v + rh * v_rs, v_rs, kb - rh, a.Ev);
  }

  // A row whose sum is NaN (a NaN score) has NaN weights at every key, as in the reference, not
  // only at the keys of its blocks.
  void nan_weights_row(T inv, T* wr) const {
    if (inv == inv) return;
    for (index_t j = 0; j < a.Lk; ++j) wr[j] = inv;
  }

  // Query panels per prefill task: wide heads (E >= 128) share each K/V row among NPW.
  int panels() const { return a.E >= 128 ? K::NPW : K::NP; }

  template <bool CAP, bool ALIBI>
  void prefill() const {
    const int np = panels();
    const index_t ngroups = ceil_div(a.Lq, index_t(np) * NR);
    const index_t ntasks = a.bh * ngroups;
    const std::size_t panel = tile_elems(a.E, a.Ev), conv = gathers() ? std::size_t(BK) * std::size_t(a.E + a.Ev) : 0,
                      held = held_elems();
    const double work = double(a.bh) * double(a.Lq) * double(a.Lk) * double(a.E + a.Ev);
    const int nt = int(min_of<index_t>(threads_for(work, a.nthreads), ntasks));
    struct Panels {
      Tile t[kMaxNP];
      Convert cv;
      Held h;
    };
    auto setup = [&] {
      Panels ps;
      T* base = static_cast<T*>(scratch(0, (np * panel + conv) * sizeof(T)));
      for (int i = 0; i < np; ++i) ps.t[i] = carve(base + i * panel);
      ps.cv.kc = base + np * panel;
      ps.cv.vc = ps.cv.kc + BK * a.E;
      ps.h = Held{nullptr, nullptr, nullptr, Held::kNone, Held::kNone, 0, 0};
      if (held) {
        T* h = static_cast<T*>(scratch(1, held * sizeof(T)));
        ps.h.k = hold_k ? h : nullptr;
        ps.h.v = hold_v ? h + (hold_k ? a.Lk * a.E : 0) : nullptr;
        ps.h.zero = static_cast<index_t*>(scratch(3, std::size_t(a.bh) * sizeof(index_t)));
        for (index_t i = 0; i < a.bh; ++i) ps.h.zero[i] = 0;
      }
      return ps;
    };
    if (a.q_lens) return prefill_ragged<CAP, ALIBI>(nt, setup);
    // One group a problem, every problem's keys as many and in blocks as long (ALiBi's slopes
    // cut them differently): tasks of one cost, in equal runs, as the decode takes them. Each
    // thread then takes the same heads call after call, with their rows in its caches, the heads
    // of a GQA group mostly on one thread read their K/V once, and no counter is shared per task
    // (a 32-token Llama-shaped prefill: 0.93x the time on demand). Else on demand.
    // Either way a problem's groups come one after another (last first: near the end of a causal
    // sequence they do the most work), so that a thread's next task reads the K/V rows its last
    // one left in L2, not another head's. Taken groups first, every head's last group before any
    // head's next, the time was 1.02-1.05x this (AVX-512) and 1.00-1.11x (AVX2): L4096 D128
    // 1.04 / 1.11, causal H32 L1024 1.10 on AVX2 (Xeon, 2 threads, one process).
    bool even = ngroups == 1;
    const Problem p0 = problem(0);
    for (index_t i = 1; even && i < a.bh; ++i) {
      const Problem p = problem(i);
      even = key_span(p) == key_span(p0) && p.bk == p0.bk;
    }
    team(nt, setup, [&](Panels& ps, const Team& tm) {
      tm.for_each(ntasks, !even, [&](index_t i) {
        const index_t g = ngroups - 1 - i % ngroups;
        take_group<CAP, ALIBI>(problem(i / ngroups), g * np * NR, np, ps);
      });
    });
  }

  // Problems of different lengths (varlen): only the groups that hold queries, the longest
  // problems first and each problem's groups one after another, last first, so that the two
  // threads share its keys in cache as one call per sequence would.
  template <bool CAP, bool ALIBI, class Setup>
  void prefill_ragged(int nt, Setup& setup) const {
    const int np = panels();
    const index_t rows = index_t(np) * NR;
    std::vector<index_t> order(std::size_t(a.bh), 0);
    for (index_t i = 0; i < a.bh; ++i) order[std::size_t(i)] = i;
    std::stable_sort(order.begin(), order.end(), [&](index_t x, index_t y) { return a.q_lens[x] > a.q_lens[y]; });
    std::vector<index_t> first(order.size() + 1, 0);  // task index of each problem's first group
    for (std::size_t i = 0; i < order.size(); ++i) first[i + 1] = first[i] + ceil_div(a.q_lens[order[i]], rows);
    team(nt, setup, [&](auto& ps, const Team& tm) {
      tm.for_each(first.back(), true, [&](index_t t) {
        const std::size_t i = std::size_t(std::upper_bound(first.begin(), first.end(), t) - first.begin()) - 1;
        const index_t g = first[i + 1] - 1 - t;
        take_group<CAP, ALIBI>(problem(order[i]), g * rows, np, ps);
      });
    });
  }

  // Group q0 of problem p (query_group), its K / V rows read from the thread's copy where they
  // are worth it (worth_holding): the same call on another Attention, whose K / V are the copy.
  // (Not a HOLD flag through query_group and key_block: a second instantiation of the panel loop
  // moved the compiler to take accumulate out of line, and the other calls ran 1.02-1.04x slower,
  // AVX-512 causal H32 L1024 D128.)
  template <bool CAP, bool ALIBI, class Panels>
  void take_group(const Problem& p, index_t q0, int np, Panels& ps) const {
    if (!ps.h.zero || q0 >= p.Lq || !worth_holding(p.Lq)) return query_group<CAP, ALIBI>(p, q0, np, ps.t, ps.cv);
    const GroupSpan gs = group_span(p, q0, np);
    hold_rows(p, gs.beg, gs.end, ps.h);
    AttnArgs args = a;
    if (hold_k) args.k = ps.h.k, args.koff = ps.h.zero, args.k_rs = a.E;
    if (hold_v) args.v = ps.h.v, args.voff = ps.h.zero, args.v_rs = a.Ev;
    Attention(args).template query_group<CAP, ALIBI>(p, q0, np, ps.t, ps.cv);
  }

  // ---------------------------------------------------------------- short prefill (query rows)

  // Short problems, whose keys all fit a small tile, the decode's orientation: a row per query,
  // vectorised across keys. A task is a head group's K/V and a run of query rows of each head:
  //   K^T = s2 K[kp0:kp1]^T                 (packed once for the group's heads: the only copy)
  //   S[r0:r0+mr] = mods(Q rows K^T)         (GEMM micro-kernel, A = Q rows in place)
  //   per row: masked; m = max(S); P = exp2(S - m); l = sum(P); P /= l (without a sink)
  //   O[r0:r0+mr] = P V, / (l + sink) with one (GEMM micro-kernel, B = V rows in place, into out)
  // With every key in one tile the softmax needs no running statistics, and the panel path's
  // Q^T packing and O^T transpose, per query head, go: at 32 queries of 128 those were a sixth
  // of the time, and a GQA group shares one K^T.
  // Taken where a position edge (causal, a window) crosses the tiles, whose masked halves the
  // panel path computes in whole panels. A/B against it (Xeon, AVX-512, 2 threads, time panels /
  // rows): causal 32-token prefills 1.21-1.45 (H1-H32, D64 and D128), L128 1.03-1.19, L256
  // 1.02-1.07 but 0.94 without causal, and without causal 0.82-1.06 up to 128 keys (heads 1-12).
  static constexpr index_t kRowsMaxKeys = 128;  // K^T of 128-wide heads: 64 KiB
  static constexpr index_t kRowsMaxQueries = 256;
  static bool use_rows(const AttnArgs& args) {
    const bool edge = args.causal || args.win_left < kNoLimit || args.win_right < kNoLimit;
    // Float rows in place, or a paged cache's rows copied into the task's K^T and a V copy: the
    // same rows (and row strides) take the same path whatever the layout, so that a paged cache
    // gives the bits of a contiguous one (docs/api.md).
    const bool rows_ok = !kHalf && !page_apart(args.k_rs, args.E) && !page_apart(args.v_rs, args.Ev);
    return edge && !args.q_lens && args.Lk <= kRowsMaxKeys && args.Lq <= kRowsMaxQueries && args.Ev % VL == 0 &&
           rows_ok;
  }

  // Query rows [i0, i1) of the `group` heads from h0 (one K/V): see above. kt and s are the
  // task's scratch, E x ldk and MR x ldk. Float K/V only (run).
  PYATTN_PHASE void rows_task(index_t h0, index_t i0, index_t i1, T* kt, T* s, T* vcopy, index_t ldk) const {
    const index_t E = a.E, Ev = a.Ev;
    index_t kp0 = kNoLimit, kp1 = 0;  // the keys some row may see, from a whole vector
    for (index_t x = 0; x < a.group; ++x) {
      const Problem p = problem(h0 + x);
      kp0 = min_of<index_t>(kp0, lo(p, i0) / VL * VL);
      kp1 = max_of<index_t>(kp1, hi(p, i1 - 1));
    }
    // K^T run by run (a contiguous cache is one run); V row j at vb + (j - v0) * vrs: in place,
    // or (paged) rows [kp0, kp1) copied
    const T* vb = value + a.voff[h0];
    index_t v0 = 0, vrs = a.v_rs;
    if (kp1 > kp0) {
      const index_t nk = kp1 - kp0;
      const Problem p = problem(h0);
      for (index_t j = kp0; j < kp1;) {
        const index_t m = min_of<index_t>(kp1 - j, run(j));
        K::transpose(key_row(p, j), a.k_rs, m, E, kt + (j - kp0), ldk, UniformScale<T>{s2});
        if (a.block_table)
          for (index_t r = 0; r < m; ++r) std::copy_n(value_row(p, j + r), Ev, vcopy + (j + r - kp0) * Ev);
        j += m;
      }
      if (a.block_table) vb = vcopy, v0 = kp0, vrs = Ev;
      for (index_t e = 0; e < E; ++e)  // the last vector's padding: read, never stored
        for (index_t j = nk; j < round_up(nk, VL); ++j) kt[e * ldk + j] = T(0);
    }
    for (index_t x = 0; x < a.group; ++x) {
      const index_t h = h0 + x;
      const Problem p = problem(h);
      for (index_t r0 = i0; r0 < i1; r0 += MR) {
        const int mr = int(min_of<index_t>(MR, i1 - r0));
        const index_t cl = lo(p, r0), ch = hi(p, r0 + mr - 1);  // the rows' keys: [cl, ch)
        // the scores of whole vectors (nv columns), those past the n keys then hidden
        const index_t c0 = cl / VL * VL, n = ch > c0 ? ch - c0 : 0, nv = round_up(n, VL);
        for (index_t c = 0; c < nv; c += NR)
          rows_ukernel<K>::call(mr, E, query + a.qoff[h] + r0 * a.q_rs, a.q_rs, index_t(1), kt + (c0 - kp0) + c, ldk,
                                s + c, ldk, int(min_of<index_t>(NR, nv - c)), false);
        T inv[MR];
        softmax_rows(p, r0, mr, c0, n, nv, s, ldk, inv);
        // Keys that some rows see and others do not have P = 0 in those rows; a value row there
        // that is not finite (0 * inf = NaN) sends each row its own way.
        const bool whole = ch <= cl || edge_values_finite(p, r0, r0 + mr - 1, cl, ch - cl, vb + (cl - v0) * vrs, vrs);
        for (int r = 0; r < (whole ? 1 : mr); ++r) {
          const index_t jl = whole ? cl : lo(p, r0 + r), jh = whole ? ch : hi(p, r0 + r);
          const int rows = whole ? mr : 1;
          T* orow = out + a.ooff[h] + (r0 + r) * a.o_rs;
          if (jh <= jl) {  // no key for these rows: 0 * inv, as the panels' acc / l (NaN with a NaN sink)
            for (int x = 0; x < rows; ++x)
              for (index_t d = 0; d < Ev; ++d) orow[x * a.o_rs + d] = T(0) * inv[r + x];
            continue;
          }
          for (index_t d0 = 0; d0 < Ev; d0 += NR)
            rows_ukernel<K>::call(rows, jh - jl, s + r * ldk + (jl - c0), ldk, index_t(1), vb + (jl - v0) * vrs + d0,
                                  vrs, orow + d0, a.o_rs, int(min_of<index_t>(NR, Ev - d0)), false);
          if (!rows_normalise_p())  // out = (P V) / l, as the panels' acc / l
            for (int x = 0; x < rows; ++x) {
              T* ox = orow + x * a.o_rs;
#pragma omp simd
              for (index_t d = 0; d < Ev; ++d) ox[d] *= inv[r + x];
            }
        }
      }
    }
  }

  // Without a sink a row's l is at least 1 (its largest weight is exp2(0)) and at most its n
  // keys, so P / l turns no nonzero weight into 0, and normalising P (nv a row) costs less than
  // the output (Ev a row: 3-5% of a 32-token prefill). With a sink l can be huge, and a weight
  // that underflowed would make an inf value NaN (0 * inf) where the panels' acc / l gives inf:
  // then the output is scaled.
  bool rows_normalise_p() const { return sinks == nullptr; }

  // Rows r0 .. r0 + mr - 1 of S (queries; keys [c0, c0 + n), s2 units, rows ldk apart) into
  // their weights, in place, and 0 up to nv (whole vectors):
  //   s = masked(mods(s)); m = max(s); s = exp2(s - m); l = sum(s); inv = 1 / (l + sink)
  // then s *= inv where rows_normalise_p; and their lse and weights (s * inv) where asked for. Each step is taken for
  // every row before the next, so the rows' reductions overlap rather than wait one on the other.
  void softmax_rows(const Problem& p, index_t r0, int mr, index_t c0, index_t n, index_t nv, T* s, index_t ldk,
                    T* inv) const {
    T sub[MR], l[MR];
    for (int r = 0; r < mr; ++r) {
      T* x = s + r * ldk;
      mod_keys(p, r0 + r, c0, n, x);
      mask_row(p, r0 + r, c0, n, x, 1);
      for (index_t j = n; j < nv; ++j) x[j] = -kInf;
    }
    for (int r = 0; r < mr; ++r) {
      const T mx = K::max_row(s + r * ldk, nv, -kInf);
      sub[r] = mx == -kInf ? T(0) : mx;
    }
    for (int r = 0; r < mr; ++r) l[r] = K::exp2_sub_sum(s + r * ldk, nv, sub[r]);
    for (int r = 0; r < mr; ++r) {
      T* x = s + r * ldk;
      const index_t qi = r0 + r;
      inv[r] = inv_of(with_sink(p, sub[r], l[r]));
      const T f = rows_normalise_p() ? T(1) : inv[r];  // the weights' factor left after this
      if (rows_normalise_p()) {
#pragma omp simd
        for (index_t j = 0; j < nv; ++j) x[j] *= inv[r];
      }
      if (lse) lse[a.lseoff[p.bh] + qi * a.lse_s] = lse_of(p, sub[r], l[r]);
      if (weights) {
        T* w = weights + a.woff[p.bh] + qi * a.w_rs;
        for (index_t j = 0; j < n; ++j) w[c0 + j] = x[j] * f;
        nan_weights_row(inv[r], w);
      }
    }
  }

  void prefill_rows() const {
    const index_t ng = a.bh / a.group;
    // Query rows cut into runs of whole tiles where the groups are fewer than two a thread (each
    // run packs its own K^T). Each row's arithmetic is the same whatever the cut (its tiles start
    // at multiples of MR), so the results do not depend on the thread count.
    index_t nchunk = 1;
    if (ng < 2 * index_t(a.nthreads))
      nchunk = min_of<index_t>(ceil_div(a.Lq, MR), ceil_div(2 * index_t(a.nthreads), ng));
    const index_t rows = round_up(ceil_div(a.Lq, nchunk), MR);
    nchunk = ceil_div(a.Lq, rows);
    const index_t ntasks = ng * nchunk, ldk = round_up(a.Lk, VL) + VL;
    const double work = double(a.bh) * double(a.Lq) * double(a.Lk) * double(a.E + a.Ev);
    const int nt = int(min_of<index_t>(threads_for(work, a.nthreads), ntasks));
    const index_t vcopy = a.block_table ? a.Ev : 0;  // (a paged cache's V rows, ldk of them)
    team(
        nt, [&] { return static_cast<T*>(scratch(0, std::size_t(a.E + MR + vcopy) * std::size_t(ldk) * sizeof(T))); },
        [&](T* kt, const Team& tm) {
          tm.for_each(ntasks, nchunk > 1, [&](index_t t) {
            const index_t g = t / nchunk, i0 = (nchunk - 1 - t % nchunk) * rows;  // the last rows first
            rows_task(g * a.group, i0, min_of<index_t>(a.Lq, i0 + rows), kt, kt + a.E * ldk, kt + (a.E + MR) * ldk,
                      ldk);
          });
        });
  }

  // ---------------------------------------------------------------- decode (few queries)

  static constexpr index_t DB = 64;  // keys per decode block
  // Prefetch distance in blocks: K and V rows this far ahead are asked for one per key. With
  // none, one Zen 5 core streamed at ~70% of its rate for a plain sum; 1 and 2 measured the same
  // (on the Xeon, 4 the same as 2).
  static constexpr index_t PFD = 2;
  // Grouped int8 rows, and half rows where the kernel set streams grouped rows L / 4 keys at a
  // time (grouped_stream_keys: AVX-512), are read as streamed from memory, whatever the call's
  // size (decode_db), in blocks of kWideDB keys prefetched one
  // block ahead (the same 128 keys): each block's softmax, rescale and accumulator round trip
  // serve twice the keys. Xeon, AVX-512, one process, B1 Hq32 Hkv8 Lk32768 D128: int8
  // 1.02-1.05x, float16 1.02-1.04x; paged (B4 L4096, 16-token blocks) float16 1.03-1.05x, int8
  // 1.00x; AVX2's int8 rows 1.00x. float32 rows keep DB (paged 0.97x wide, contiguous
  // 0.99-1.00x), and so do single rows (int8 0.94-0.98x wide).
  static constexpr index_t kWideDB = 128, kWidePFD = 1;
  static constexpr index_t pfd_of(index_t db) { return db == kWideDB ? kWidePFD : PFD; }

  // Rows of a decode task: all Lq queries of the `group` heads that share one K/V, at most
  // kDecodeRows (use_decode).
  static constexpr index_t kDecodeRows = 32;
  struct Rows {
    index_t R;
    T *q, *s, *acc, *m, *l;
  };

  static std::size_t decode_scratch(index_t R, index_t E, index_t Ev) {
    return std::size_t(R) * std::size_t(E + kWideDB + Ev + 2) * sizeof(T);
  }

  // The score variants on row x's block of kb scores (query qi of problem p, keys from k0).
  void mod_keys(const Problem& p, index_t qi, index_t k0, index_t kb, T* s) const {
    const T base = T(qi + p.off - k0);
    const bool cap = mods0.cap > T(0), alibi = slopes != nullptr;
    if (cap && alibi)
      K::template mod_span<true, true>(s, kb, p.md, base, T(-1));
    else if (cap)
      K::template mod_span<true, false>(s, kb, p.md, base, T(-1));
    else if (alibi)
      K::template mod_span<false, true>(s, kb, p.md, base, T(-1));
  }

  // Where keys [k0, k0+n) of problem p lie: page[j] (a block-table entry; 0 when contiguous) and
  // slot[j] (the row within it; the key itself when contiguous).
  struct Slots {
    index_t page[kWideDB], slot[kWideDB];
  };
  void slots(const Problem& p, index_t k0, index_t n, Slots& s) const {
    if (!a.block_table) {
      for (index_t j = 0; j < n; ++j) {
        s.page[j] = 0;
        s.slot[j] = k0 + j;
      }
      return;
    }
    index_t blk = k0 / a.block_size, at = k0 % a.block_size;
    index_t page = a.block_table[p.bt0 + blk];
    for (index_t j = 0; j < n; ++j) {
      s.page[j] = page;
      s.slot[j] = at;
      if (++at == a.block_size && j + 1 < n) {
        at = 0;
        page = a.block_table[p.bt0 + ++blk];
      }
    }
  }

  //   rows[j] = where key k0 + j lies for j < n (row stride rs, page stride ps, from b0): stepped
  //   through a contiguous cache, not multiplied out from its slots (64-bit vector multiplies)
  void rows_at(const KV* b0, index_t rs, index_t ps, const Slots& s, index_t k0, index_t n, const KV** rows) const {
    if (!a.block_table) {
      const KV* row = b0 + k0 * rs;
      for (index_t j = 0; j < n; ++j, row += rs) rows[j] = row;
      return;
    }
    for (index_t j = 0; j < n; ++j) rows[j] = b0 + s.page[j] * ps + s.slot[j] * rs;
  }

  //   prefetch(b0 + page[j] * ps + slot[j] * rs, cols wide) for j in [j0, j0 + n), a run of one
  //   block's rows at a time
  // Each stream's rows in order, as over a contiguous cache. Row by row, each key's V row then
  // the K and V rows ahead in turn, a paged decode took 1.20-1.22x the contiguous cache's time
  // with one 4096-row block a sequence (the very layout of the contiguous cache) and 1.16-1.20x
  // with 16-row blocks (AVX-512, B4 Hq32 Hkv8 L4096 D128, one thread, Zen 4); by runs, 16-row
  // blocks ran 1.08-1.10x faster (two threads, one-process A/B), about the contiguous time.
  // Always inlined: GCC 12 takes a function that only prefetches for one without side effects
  // (ipa-modref: const) and drops calls to it (0.40x the contiguous cache's speed).
  template <class P>
  PYATTN_ALWAYS_INLINE static void prefetch_slots(const P* b0, index_t rs, index_t ps, const Slots& s, index_t j0,
                                                  index_t n, index_t cols) {
    for (index_t j = j0 + 1, r0 = j0; j <= j0 + n; ++j)
      if (j == j0 + n || s.slot[j] == 0) {  // a run ends where its block does
        prefetch_rows(b0 + s.page[r0] * ps + s.slot[r0] * rs, rs, j - r0, cols);
        r0 = j;
      }
  }

  //   out[j] = the int8 scale of key k0 + j for j < n (scales from s0, rs and ps apart), stepped
  //   through a contiguous cache rather than indexed from its slots
  void scales_at(const float* s0, index_t rs, index_t ps, const Slots& s, index_t k0, index_t n, T* out) const {
    if (!a.block_table) {  // (GCC versions this loop for rs == 1: a plain copy)
      const float* x = s0 + k0 * rs;
      for (index_t j = 0; j < n; ++j) out[j] = T(x[j * rs]);
      return;
    }
    for (index_t j = 0; j < n; ++j) out[j] = T(s0[s.page[j] * ps + s.slot[j] * rs]);
  }

  void finish_row(index_t g, index_t x, const T* acc, T m, T l) const {
    const index_t h = g * a.group + x / a.Lq, qi = x % a.Lq;
    const Problem p = problem(h);
    const T sub = m == -kInf ? T(0) : m;
    T* orow = out + a.ooff[h] + qi * a.o_rs;
    const T inv = inv_of(with_sink(p, sub, l));
    for (index_t d = 0; d < a.Ev; ++d) orow[d] = acc[d] * inv;
    if (lse) lse[a.lseoff[h] + qi * a.lse_s] = lse_of(p, sub, l);
  }

  // A decode task's run over keys [j0, j1) of one head group: its rows, where its K/V (and int8
  // scales) start, each row's problem (its head's ALiBi slope, its alignment), and where this
  // block's keys and those pfd_of(db) blocks ahead lie (block i's slots at ring[i % (PFD + 1)]: row j
  // is row slot[j] of page page[j], page 0 and slot = key for a contiguous cache), stepped
  // through the pages once per block rather than divided out per row.
  struct GroupRun {
    Rows r;
    Problem pg;  // the group's K/V
    index_t j0, j1;
    const KV *kb0, *vb0;
    const float *ks0, *vs0;   // int8: the scales of key j, addressed through the same slots as its row
    Problem rp[kDecodeRows];  // R = group * Lq <= kDecodeRows on this path (use_decode)
    Slots ring[PFD + 1];
  };

  //   prefetch this block's V rows [jg, jg + n) (slots cur), and the K and V rows [jg, jg + m)
  //   of the block ahead (slots as, its first an rows), m = min(n, an - jg)
  PYATTN_ALWAYS_INLINE void prefetch_keys_ahead(const KV* vb0, const Slots& cur, const GroupRun& ahead, const Slots& as,
                                                index_t an, index_t jg, index_t n) const {
    prefetch_slots(vb0, a.v_rs, a.v_ps, cur, jg, n, a.Ev);
    const index_t m = min_of<index_t>(n, an - jg);
    if (m > 0) {
      prefetch_slots(ahead.kb0, a.k_rs, a.k_ps, as, jg, m, a.E);
      prefetch_slots(ahead.vb0, a.v_rs, a.v_ps, as, jg, m, a.Ev);
    }
  }

  // Whether the call's K/V (all groups, all keys) fit in half a typical L3.
  bool decode_cached() const {
    return double(a.bh / a.group) * double(a.Lk) * double(a.E + a.Ev) * double(sizeof(KV)) <= 16.0 * (1 << 20);
  }
  // Keys per decode block for R rows: kWideDB for grouped int8 rows, and grouped half rows where
  // the kernel set says grouped_stream_keys, else DB. Those rows are read as streamed from memory even where
  // the call's K/V would fit in cache (decode_cached): a model's other layers pass through the
  // cache between two steps of one layer. Hq32 Hkv8 Lk4096 D128 (8-16 MiB), one process: from
  // memory int8 1.36-1.38x faster, float16 1.22x, bfloat16 1.19-1.21x (AVX2 int8 1.33-1.48x); in
  // cache, called back to back, 0.94-0.98x (AVX2 0.97-1.03x).
  index_t decode_db(index_t R) const {
    return R > 1 && kHalf && (kInt8 || grouped_stream_keys<K>::value) ? kWideDB : DB;
  }
  // f(std::integral_constant<index_t, db>) for db = decode_db(R): decode_block's instance for
  // it (the kWideDB one exists only for half and int8 K/V, the only ones decode_db gives it)
  template <class F>
  void with_db(index_t R, F&& f) const {
    if constexpr (kHalf)
      if (decode_db(R) == kWideDB) return f(std::integral_constant<index_t, kWideDB>());
    f(std::integral_constant<index_t, DB>());
  }

  // Starts group g's run over keys [j0, j1) in rows r: q = query * s2, m = -inf, l = 0, acc = 0.
  void decode_start(index_t g, index_t j0, index_t j1, const Rows& r, GroupRun& u) const {
    const index_t Lq = a.Lq, E = a.E, Ev = a.Ev;
    const index_t h0 = g * a.group;
    for (index_t x = 0; x < r.R; ++x) {
      const T* qsrc = query + a.qoff[h0 + x / Lq] + (x % Lq) * a.q_rs;
      T* qd = r.q + x * E;
      for (index_t e = 0; e < E; ++e) qd[e] = qsrc[e] * s2;
      r.m[x] = -kInf;
      r.l[x] = T(0);
      for (index_t d = 0; d < Ev; ++d) r.acc[x * Ev + d] = T(0);
    }
    u.r = r;
    u.pg = problem(h0);
    u.j0 = j0;
    u.j1 = j1;
    const index_t db = decode_db(r.R);
    for (index_t i = 0; i < pfd_of(db) && j0 + i * db < j1; ++i)
      slots(u.pg, j0 + i * db, min_of<index_t>(db, j1 - j0 - i * db), u.ring[i]);
    u.kb0 = key + a.koff[u.pg.bh];
    u.vb0 = value + a.voff[u.pg.bh];
    u.ks0 = kInt8 ? a.k_scale + a.ksoff[u.pg.bh] : nullptr;
    u.vs0 = kInt8 ? a.v_scale + a.vsoff[u.pg.bh] : nullptr;
    for (index_t x = 0; x < r.R; ++x) u.rp[x] = problem(h0 + x / Lq);
  }

  // Whether single rows streamed from memory take the key-by-key loop with prefetches
  // (decode_block) rather than several keys at a time with none: always through a block table;
  // over contiguous K/V where decode_prefetch_streams (or the kernel set's rows are as long as
  // stream_keys_row_bytes, unless PYATTN_DECODE_PREFETCH decides), and only for key rows past two
  // cache lines. A short row leaves the key-by-key loop a few multiply-adds per key against a
  // reduction and, for float16 / bfloat16 / int8, conversions: over contiguous caches streamed
  // from memory, L keys at a time ran 1.2-1.9x faster for D64 float16 / bfloat16 and 1.1-1.9x
  // for D64 and D128 int8, on both x86 kernel sets (B1-B4, 2 threads, Zen 4); D128 halves went
  // either way (AVX2 0.74-0.87x), and through a block table of 16-row blocks short rows without
  // prefetches ran 0.59-0.96x.
  bool decode_stream_keys(bool cached) const {
    if (cached) return false;
    if (a.block_table) return true;
    if (short_key_rows()) return false;
    const index_t wide = stream_keys_row_bytes<K>::value;
    if (wide > 0 && a.E * index_t(sizeof(KV)) >= wide && decode_prefetch_env() < 0) return true;
    return decode_prefetch_streams();
  }

  // Key rows of at most two cache lines: the rows decode_stream_keys and decode_block treat apart.
  bool short_key_rows() const { return a.E * index_t(sizeof(KV)) <= 128; }

  //   s[j] = q . (k_j * ks[j]) element by element, for each key j whose int8 scale is not
  //   finite. scale (q . k) equals it for finite scales only: an inf scale times a zero element
  //   is NaN in the dequantised row (as in the reference, and in the prefill, which dequantises
  //   first), where scale (q . k) is +-inf: -inf would hide a key the query sees, and a softcap
  //   would make +inf finite. Taken only for a row with an infinite score, which a non-finite
  //   scale gives wherever the two differ. (A pass over the scales to find them cost single int8
  //   decode rows 3-8%.)
  template <class KRow>
  void int8_scores_at(const T* q, const Slots& cur, index_t kb, const T* ks, T* s, KRow&& krow) const {
    for (index_t j = 0; j < kb; ++j) {
      if (std::isfinite(ks[j])) continue;
      const KV* k = krow(cur, j);
      T acc = T(0);
      for (index_t e = 0; e < a.E; ++e) acc += q[e] * (T(k[e]) * ks[j]);
      s[j] = acc;
    }
  }

  // Block blk of run u, keys [k0, k0 + db) cut at u.j1; leaves unnormalised acc, running max m
  // (log2 units) and sum l per row. stream_keys (decode_stream_keys): single rows streamed from
  // memory, prefetched key by key, or several keys at a time with none. The rows prefetched
  // (where they are) are those of block ablk of run ahead: u's own block pfd_of(db) ahead, or
  // (decode_groups) the block read that many calls on.
  // db (decode_db): a constant of each instance, so that the single rows' loops keep the bounds they
  // had with one block size (AVX2 int8 rows 1.02-1.04x slower with db read from u).
  template <index_t db>
  PYATTN_PHASE void decode_block(GroupRun& u, index_t k0, index_t blk, const GroupRun& ahead, index_t ablk, bool cached,
                                 bool stream_keys) const {
    const index_t Lq = a.Lq, E = a.E, Ev = a.Ev, j1 = u.j1;
    Rows& r = u.r;
    const Problem& pg = u.pg;
    const Problem* rp = u.rp;
    Slots* ring = u.ring;
    const KV* kb0 = u.kb0;
    const KV* vb0 = u.vb0;
    const float* ks0 = u.ks0;
    const float* vs0 = u.vs0;
    auto krow = [&](const Slots& s, index_t j) { return kb0 + s.page[j] * a.k_ps + s.slot[j] * a.k_rs; };
    const Slots& as = ahead.ring[ablk % (PFD + 1)];
    const index_t an = min_of<index_t>(db, ahead.j1 - (ahead.j0 + ablk * db));  // rows to prefetch
    auto akrow = [&](index_t j) { return ahead.kb0 + as.page[j] * a.k_ps + as.slot[j] * a.k_rs; };
    auto avrow = [&](index_t j) { return ahead.vb0 + as.page[j] * a.v_ps + as.slot[j] * a.v_rs; };
    T ks[db];  // int8: this block's key scales, then its value scales
    constexpr index_t pfd = pfd_of(db);
    const index_t kb = min_of<index_t>(db, j1 - k0), k1 = k0 + pfd * db, nb = min_of<index_t>(db, j1 - k1);
    Slots* cur = &ring[blk % (PFD + 1)];
    Slots* nxt = &ring[(blk + pfd) % (PFD + 1)];
    if (nb > 0) slots(pg, k1, nb, *nxt);
    // s[x, j] = q_x . k_j. Streamed from memory (stream_keys, grouped float32 rows past the
    // cached size, grouped half and int8 rows always: decode_db), key rows are read one after
    // the other and their rows prefetched four keys at a time, a stream at a time (prefetch_slots):
    // this block's V (for pv_rows below), and K and V pfd_of(db) blocks ahead, so that neither
    // stream starts cold at a block boundary. (One key's three rows at a time, streams
    // interleaved, the key-by-key loop ran 1.04-1.13x slower for single rows, H32 Lk4096-16384
    // D128, float32 and halves on both x86 sets (AVX2 bfloat16 once 0.95), int8 0.95-1.02; AVX2's
    // B4 Hq32 Hkv8 float32 caches 1.04-1.06x. Zen 4, one-process A/Bs.)
    // Over K/V that fit in cache (other than those read as streamed: decode_db), several keys
    // at a time (kernels/x86_simd.h dot_keys: L for one query row, L / 4 for grouped rows),
    // with no software prefetch: from L2/L3 the
    // hardware's keeps up, and the prefetches cost more than they save (grouped rows, Hq4 Hkv1
    // Lk4096 D128, one thread: 23.4 ns a key with them, 16.0 without).
    // Streamed from memory, the key-by-key loop is faster for float rows on the AMD cores timed
    // (L keys at a time measured 1.10-1.15x slower on one thread, H32 Lk4096 D128; L / 4 keys of
    // grouped rows 1.24-1.55x, Hkv8 Lk32768 D128, their prefetches issued 16 keys at a time;
    // Zen 3's single rows: decode_prefetch_streams, frame/api.h), but an int8 cache, bound by
    // its conversions, takes the grouped rows L / 4 keys at a time (1.15x faster), and so does
    // every cache where the kernel set says so (grouped_stream_keys), the prefetches issued
    // four keys at a time. On an Intel Xeon, single rows over contiguous K/V
    // ran faster L keys at a time without prefetches (decode_prefetch_streams: GPT-2 B4 c1024
    // 1.14x, H32 c8192 1.08x; with AVX2 1.25x and 0.99x, though AVX2's D128 rows later ran
    // 1.07-1.09x faster key by key: stream_keys_row_bytes), but 1.08x slower through a block
    // table; its grouped rows kept the key-by-key loop (L / 4 keys without prefetches:
    // 1.11-1.28x slower on 64-128 MiB contiguous caches, 1.65x paged).
    // The first and last branches look alike but stay apart: one branch for both (the same
    // arithmetic, bit for bit) made the streamed key-by-key loop between them 1.06-1.09x slower
    // (GPT-2 B4 c1024, three one-process A/Bs), this loop's known sensitivity to code layout.
    if (r.R == 1 && !stream_keys) {
      const KV* krows[db];
      rows_at(kb0, a.k_rs, a.k_ps, *cur, k0, kb, krows);
      if (prefetch_cached_rows<K>::value && decode_prefetch_streams() && cached && an >= kb &&
          (!kHalf || kInt8 || short_key_rows())) {
        // The call's K/V fit in cache, but a model reads them from memory (its other layers
        // pass through the cache between two steps of this one): the rows PFD blocks ahead are
        // prefetched among the keys (dot_keys' pk). On AVX-512 in cache that cost 1-7%; from
        // memory it saved 1.05-1.33x (float32 D64 / D128, float16 D64, int8 D128; 2 threads,
        // Zen 4), but cost float16 / bfloat16 D128 rows 1.12-1.25x, which go without. AVX2
        // lost both ways (0.84-0.86 in cache, 0.85-0.88 from memory): kPrefetchCachedRows.
        // On the Intel Xeon they cost float32 D64 rows 1.06-1.15x within the L3 (GPT-2 B1/B4,
        // every layer's K/V 36-72 MiB, read in turn) and 1.10-1.15x called back to back, and
        // saved 1.02-1.04x from memory: taken only where decode_prefetch_streams (not on Intel).
        const KV* pk[db];
        const KV* pv[db];
        for (index_t j = 0; j < kb; ++j) {
          pk[j] = akrow(j);
          pv[j] = avrow(j);
        }
        K::dot_keys(r.q, E, index_t(1), krows, kb, E, r.s, db, pk, pv, Ev);
      } else {
        K::dot_keys(r.q, E, index_t(1), krows, kb, E, r.s, db);
      }
    } else if (r.R == 1 || !(cached || kInt8 || grouped_stream_keys<K>::value)) {
      for (index_t jg = 0; jg < kb; jg += 4) {
        const index_t n = min_of<index_t>(4, kb - jg);
        prefetch_keys_ahead(vb0, *cur, ahead, as, an, jg, n);
        for (index_t j = jg; j < jg + n; ++j) K::dot_rows(r.q, E, r.R, krow(*cur, j), E, r.s + j, db);
      }
    } else {
      const KV* krows[db];
      rows_at(kb0, a.k_rs, a.k_ps, *cur, k0, kb, krows);
      // Keys per dot_keys call, their prefetches (streamed) just before it. Streamed half rows
      // asked for 16 keys' rows at once (192 prefetches) ran 1.17-1.35x slower than four keys'
      // (AVX-512, Hq32 Hkv8 Lk32768 D128, one and two threads); int8 rows alike either way.
      const bool streamed = !cached || db == kWideDB;
      const index_t KG = streamed ? 4 : 16;
      for (index_t jg = 0; jg < kb; jg += KG) {
        const index_t n = min_of<index_t>(KG, kb - jg);
        // The same lines as prefetch_keys_ahead, addressed as key * rs: through its scan of the
        // slots, contiguous float32 and float16 grouped caches ran 0.97x (AVX-512, one-process A/B).
        if (streamed && !a.block_table) {  // a contiguous cache: runs of rows, key * rs on
          const index_t ak = ahead.j0 + ablk * db + jg, m = min_of<index_t>(n, an - jg);
          prefetch_rows(vb0 + (k0 + jg) * a.v_rs, a.v_rs, n, Ev);
          if (m > 0) {
            prefetch_rows(ahead.kb0 + ak * a.k_rs, a.k_rs, m, E);
            prefetch_rows(ahead.vb0 + ak * a.v_rs, a.v_rs, m, Ev);
          }
        } else if (streamed) {  // through a block table: the same runs, cut where a block ends
          prefetch_keys_ahead(vb0, *cur, ahead, as, an, jg, n);
        }
        K::dot_keys(r.q, E, r.R, krows + jg, n, E, r.s + jg, db);
      }
    }
    if constexpr (kInt8) scales_at(ks0, a.ks_rs, a.ks_ps, *cur, k0, kb, ks);
    for (index_t x = 0; x < r.R; ++x) {
      const Problem& p = rp[x];
      const index_t qi = x % Lq;
      T* s = r.s + x * db;
      if constexpr (kInt8) {  // q . (scale k) = scale (q . k), unless that is infinite (int8_scores_at)
        unsigned inf = 0;
        for (index_t j = 0; j < kb; ++j) {
          s[j] *= ks[j];
          inf |= unsigned(std::abs(s[j]) == kInf);
        }
        if (inf) int8_scores_at(r.q + x * E, *cur, kb, ks, s, krow);
      }
      mod_keys(p, qi, k0, kb, s);
      mask_row(p, qi, k0, kb, s, 1);
      const T mx = K::max_row(s, kb, r.m[x]);
      const T sub = mx == -kInf ? T(0) : mx;
      const T alpha = r.m[x] == -kInf ? T(0) : exp2_floored(T(r.m[x] - sub));
      r.m[x] = mx;
      r.l[x] = alpha * r.l[x] + K::exp2_sub_sum(s, kb, sub);
      if (alpha != T(1)) {
        T* ax = r.acc + x * Ev;
#pragma omp simd
        for (index_t d = 0; d < Ev; ++d) ax[d] *= alpha;
      }
    }
    if constexpr (kInt8) {  // sum_j p_j (scale_j v_j): the value scales join P, once l is taken
      scales_at(vs0, a.vs_rs, a.vs_ps, *cur, k0, kb, ks);
      for (index_t x = 0; x < r.R; ++x)
        for (index_t j = 0; j < kb; ++j) r.s[x * db + j] *= ks[j];
    }
    // acc_x += sum_j p[x, j] v_j, the accumulator chunk held in registers over the block's
    // rows wherever they lie
    const KV* vrows[db];
    rows_at(vb0, a.v_rs, a.v_ps, *cur, k0, kb, vrows);
    // Keys hidden by position stay out of a row's output even as 0 * NaN (as in the prefill's
    // accumulate): where an edge crosses the block and a value row is not finite, each row
    // takes only the keys it sees.
    index_t rl = 0, rh = kb;  // rows [0, rl) and [rh, kb) are hidden from some row x
    for (index_t x = 0; x < r.R; ++x) {
      const auto [jl, jh] = seen(rp[x], x % Lq, k0, kb);
      rl = max_of<index_t>(rl, jl);
      rh = min_of<index_t>(rh, jh);
    }
    rh = max_of<index_t>(rh, rl);
    if ((rl == 0 && rh == kb) || (finite_kv_rows(vrows, ks, 0, rl, Ev) && finite_kv_rows(vrows, ks, rh, kb, Ev))) {
      K::pv_rows(r.s, db, r.R, kb, vrows, Ev, r.acc);
    } else {
      for (index_t x = 0; x < r.R; ++x) {
        const auto [jl, jh] = seen(rp[x], x % Lq, k0, kb);
        if (jh > jl) K::pv_rows(r.s + x * db + jl, db, 1, jh - jl, vrows + jl, Ev, r.acc + x * Ev);
      }
    }
  }

  // Runs keys [j0, j1) of head group g in rows r, as decode_groups(g, 1, ...) does. Kept apart
  // for the single runs every contiguous decode takes: here the compiler sees that the run
  // prefetched from is the run itself (through decode_groups: 4.8% more instructions a decode).
  void decode_chunk(index_t g, index_t j0, index_t j1, Rows& r) const {
    GroupRun u;
    decode_start(g, j0, j1, r, u);
    const bool cached = decode_cached();
    const bool stream_keys = decode_stream_keys(cached);
    with_db(r.R, [&](auto c) {
      constexpr index_t db = decltype(c)::value;
      for (index_t k0 = j0, blk = 0; k0 < j1; k0 += db, ++blk)
        decode_block<db>(u, k0, blk, u, blk + pfd_of(db), cached, stream_keys);
    });
  }

  // Runs keys [j0, j1) of head groups [g0, g0 + n) in rows rs[0..n), a block of each group in
  // turn (each group's arithmetic is that of a run on its own); leaves unnormalised acc, running
  // max m (log2 units) and sum l per row. Through a paged cache a block's heads lie side by side:
  // block 16 makes one head's rows an 8 KB run, which read one head at a time cost 1.10-1.27x the
  // contiguous cache's time (blocks of 64 rows: 0.99-1.05); eight heads at a time, 1.06-1.13x (B4
  // Hq32 Hkv8 L4096 D128). Each call prefetches the rows the call pfd_of(db) later reads (the
  // next groups' in this block, or the next block's). Each
  // group prefetching its own block PFD ahead asked PFD x n calls early, and the rows left L2
  // before their turn (1.11-1.21x).
  static constexpr index_t kMaxRun = 8;
  // Whether the next group's K rows lie between this group's (K/V viewed as (B, L, H, D), or
  // sliced from a fused projection): read a group at a time, each row is a page or more from
  // the last, and a block of one group's rows fills a few cache sets. Taken as through a block
  // table, several groups a block at a time read their rows side by side. View over contiguous
  // time, one group / eight groups at a time (Xeon, AVX-512, one process): H32 Lk4096 D128
  // 1.16-1.22 / 0.68-0.71, Hq32 Hkv8 1.53-1.72 / 1.16-1.23, H8 1.49-1.98 / 1.13-1.48, GPT-2 B4
  // H12 Lk1024 D64 1.55-1.58 / 1.21-1.23, H32 Lk16384 1.80-1.85 / 1.13. (Prefetching these
  // rows one by one, as through a block table, made them slower still.)
  bool heads_interleaved() const {
    if (a.bh / a.group < 2 || a.k_rs <= a.E) return false;
    const index_t d = a.koff[a.group] - a.koff[0];
    return (d < 0 ? -d : d) < a.k_rs;
  }
  void decode_groups(index_t g0, index_t n, index_t j0, index_t j1, Rows* rs) const {
    GroupRun u[kMaxRun];
    for (index_t i = 0; i < n; ++i) decode_start(g0 + i, j0, j1, rs[i], u[i]);
    const bool cached = decode_cached();
    const bool stream_keys = decode_stream_keys(cached);
    with_db(rs[0].R, [&](auto c) {
      constexpr index_t db = decltype(c)::value, pfd = pfd_of(db);
      for (index_t k0 = j0, blk = 0; k0 < j1; k0 += db, ++blk)
        for (index_t i = 0; i < n; ++i)
          decode_block<db>(u[i], k0, blk, u[(i + pfd) % n], blk + (i + pfd) / n, cached, stream_keys);
    });
  }

  void decode() const {
    const index_t ng = a.bh / a.group, R = a.group * a.Lq, Ev = a.Ev;
    // Keys [kbeg, kend) of each group: all that its queries may see. They are cut into the same
    // number of chunks for every group: enough tasks to feed 8 threads, never under 256 keys.
    // The split does not depend on the thread count, so results are identical for any number.
    index_t span = 0;
    bool even = true;  // every group's tasks as long as every other's
    for (index_t g = 0; g < ng; ++g) {
      const Problem p = problem(g * a.group);
      const index_t n = key_span(p);
      even = even && (g == 0 || n == span);
      span = max_of<index_t>(span, n);
    }
    index_t nchunk = 1;
    if (ng < 8) nchunk = max_of<index_t>(1, min_of<index_t>(ceil_div(8, ng), span / 256));
    // Through a paged cache, or over interleaved heads, a task takes hpt groups (consecutive
    // heads, whose rows lie side by side) over the same keys, as decode_groups: as many as leave
    // a task a thread, since both layouts are read best the more heads a task takes. Interleaved
    // heads, view over contiguous time, two tasks a thread / one: Hq32 Hkv8 Lk512 D128 1.25 /
    // 1.16, Lk4096 1.16 / 1.03, H8 Lk4096 1.24 / 1.04 (AVX-512, one process). Paged, 16-row
    // blocks, B1 Hq32 Hkv8 Lk32768 D128: one task a thread (4 heads) 1.05-1.08x faster than two
    // (2 heads), B2 and B4 the same (AVX-512, 2 threads, one-process A/B, Zen 4).
    index_t hpt = 1;
    if (a.block_table || heads_interleaved())
      while (hpt < kMaxRun && ng % (2 * hpt) == 0 && ng / (2 * hpt) * nchunk >= index_t(a.nthreads)) hpt *= 2;
    const index_t ntasks = ng / hpt * nchunk;
    const std::size_t part = std::size_t(R) * std::size_t(Ev + 2);  // acc, m, l per group and chunk
    T* parts = nchunk > 1 ? static_cast<T*>(scratch(2, std::size_t(ng * nchunk) * part * sizeof(T))) : nullptr;
    const std::size_t bytes = std::size_t(round_up(index_t(decode_scratch(R, a.E, Ev)), 64));  // one group's rows
    // threads_for counts GEMM-rate multiply-adds; streamed from memory or cache, a decode
    // multiply-add costs about three (measured: ~19 G/s on one Zen 5 core, ~60 G/s in the tile).
    const double work = 3.0 * double(a.bh) * double(a.Lq) * double(span) * double(a.E + a.Ev);
    const int nt = int(min_of<index_t>(threads_for(work, a.nthreads), ntasks));

    const index_t db = decode_db(R);  // (as decode_start sets each run's)
    auto carve_rows = [&](T* base) {
      Rows r;
      r.R = R;
      r.q = base;
      r.s = r.q + R * a.E;
      r.acc = r.s + R * db;
      r.m = r.acc + R * Ev;
      r.l = r.m + R;
      return r;
    };
    // Chunk c of group g's keys: [j0, j1).
    auto keys = [&](index_t g, index_t c) {
      const Problem p = problem(g * a.group);
      const index_t kbeg = lo(p, 0), kend = max_of<index_t>(kbeg, hi(p, a.Lq - 1));
      const index_t chunk = round_up(ceil_div(kend - kbeg, nchunk), db);
      const index_t j0 = min_of<index_t>(kend, kbeg + c * chunk), j1 = min_of<index_t>(kend, j0 + chunk);
      return std::pair<index_t, index_t>(j0, j1);
    };
    auto task = [&](index_t t, T* base) {
      const index_t g0 = t / nchunk * hpt, c = t % nchunk;
      Rows rs[kMaxRun];
      index_t j0[kMaxRun], j1[kMaxRun];  // group g0 + i's keys
      bool same = true;                  // every group of the task over the same keys (not so with kv_lens)
      for (index_t i = 0; i < hpt; ++i) {
        rs[i] = carve_rows(base + std::size_t(i) * bytes / sizeof(T));
        std::tie(j0[i], j1[i]) = keys(g0 + i, c);
        same = same && j0[i] == j0[0] && j1[i] == j1[0];
      }
      if (hpt > 1 && same) {
        decode_groups(g0, hpt, j0[0], j1[0], rs);
      } else {
        for (index_t i = 0; i < hpt; ++i) decode_chunk(g0 + i, j0[i], j1[i], rs[i]);
      }
      for (index_t i = 0; i < hpt; ++i) {
        const index_t g = g0 + i;
        const Rows& r = rs[i];
        if (!parts) {
          for (index_t x = 0; x < R; ++x) finish_row(g, x, r.acc + x * Ev, r.m[x], r.l[x]);
          continue;
        }
        T* pt = parts + (g * nchunk + c) * part;
        for (index_t x = 0; x < R * Ev; ++x) pt[x] = r.acc[x];
        for (index_t x = 0; x < R; ++x) {
          pt[R * Ev + x] = r.m[x];
          pt[R * Ev + R + x] = r.l[x];
        }
      }
    };
    // Merge the chunks of group g: M = max m_c; acc = sum exp2(m_c - M) acc_c; l likewise.
    auto merge = [&](index_t g, T* acc) {
      for (index_t x = 0; x < R; ++x) {
        T M = -kInf;
        for (index_t c = 0; c < nchunk; ++c) {
          const T mc = parts[(g * nchunk + c) * part + R * Ev + x];
          M = mc > M ? mc : M;
        }
        const T sub = M == -kInf ? T(0) : M;
        T l = T(0);
        for (index_t d = 0; d < Ev; ++d) acc[d] = T(0);
        for (index_t c = 0; c < nchunk; ++c) {
          const T* pt = parts + (g * nchunk + c) * part;
          const T mc = pt[R * Ev + x];
          const T w = mc == -kInf ? T(0) : exp2_floored(T(mc - sub));
          l += w * pt[R * Ev + R + x];
          for (index_t d = 0; d < Ev; ++d) acc[d] += w * pt[x * Ev + d];
        }
        finish_row(g, x, acc, M, l);
      }
    };

    team(
        nt, [&] { return static_cast<T*>(scratch(0, std::size_t(hpt) * bytes)); },
        [&](T* base, const Team& tm) {
          // One task per group, all of one length: equal runs, so each thread takes the same
          // heads call after call and a decode step whose K/V fit its L2 finds them there (GPT-2
          // c128, B1 and B4: 0.93x the time of taking them on demand). Groups cut into chunks
          // (the last one shorter) or of uneven lengths (kv_lens, windows): on demand.
          tm.for_each(ntasks, !(even && nchunk == 1), [&](index_t t) { task(t, base); });
          if (parts) tm.for_each(ng, false, [&](index_t g) { merge(g, carve_rows(base).acc); });
        });
  }

  // Decode when each K/V row would otherwise be read for a single query tile that is mostly
  // padding: few queries per head group, and no weights asked for.
  static bool use_decode(const AttnArgs& args) {
    return !args.weights && !args.q_lens && args.Lq * args.group <= kDecodeRows && args.Lq <= 8;
  }

  static void run(const AttnArgs& args) {
    if (args.bh == 0 || args.Lq == 0) return;
    Attention self(args);
    if (use_decode(args)) return self.decode();
    if constexpr (!kHalf)  // K/V read in place
      if (use_rows(args)) return self.prefill_rows();
    const bool cap = args.softcap > 0, alibi = args.alibi != nullptr;
    if (cap && alibi) return self.template prefill<true, true>();
    if (cap) return self.template prefill<true, false>();
    if (alibi) return self.template prefill<false, true>();
    self.template prefill<false, false>();
  }
};
