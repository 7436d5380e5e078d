// Flash-style fused attention, written once and instantiated per ISA.
//
// Prefill (any Lq): one task = one (batch*head, NP query panels of NR queries). A panel works in
// the transposed orientation S^T = K Q^T so that the micro-kernel broadcasts K rows straight from
// memory and vectorises across queries: K and V are never packed or copied, only the small
// Q^T tile is (with scale*log2(e) folded in). Per key block of BK keys:
//   S^T = K_blk Q^T                         (GEMM micro-kernel, A = K rows, B = Q^T)
//   m' = m, or colmax(S^T) where that exceeds m by over kSlack; a = exp2(m - m');
//   P^T = exp2(S^T - m'); l = a*l + colsum(P^T)
//   acc^T = a * acc^T + V_blk^T P^T         (GEMM micro-kernel, A = V^T, B = P^T)
// so every softmax statistic is a vector over the panel's queries. The reference m is a lazy
// running max: P <= 2^kSlack cannot overflow, the accumulator is rescaled only when a score
// jumps well past m, and once every query of a panel has a reference, an unmasked block needs
// no max pass at all: its exp2 is fused into the score kernel's store (a block that turns out
// to exceed the slack is recomputed the two-pass way). The NP panels of a task share each K and
// V row read. Scratch per thread is NP * NR * (E + BK + Ev + 8) elements whatever the sequence
// lengths.
//
// Decode (few queries, long Lk): one task = (group of heads sharing K/V, chunk of keys); all
// queries of the group are rows that share each K and V row read; chunks are merged exactly
// through their log-sum-exp, so both cores stream K/V even when batch*heads is 1.
#pragma once

template <class K>
struct Attention {
  using T = typename K::T;
  static constexpr int MR = K::MR, NR = K::NR, BK = K::BK;
  static constexpr T kInf = NumLimits<T>::inf;
  // How far (log2 units) a score may exceed its query's reference before the reference moves:
  // P <= 256 keeps l and acc far from overflow, as in FlashAttention-4's conditional rescaling.
  static constexpr T kSlack = T(8);

  const AttnArgs& a;
  const T *query, *key, *value;  // read in place: only the small Q^T panel tile is ever packed
  T *out, *lse, *weights;        // lse and weights are null unless asked for
  T s2;                          // scale * log2(e), folded into Q
  index_t coff;                  // causal: query i may see keys j <= i + coff

  explicit Attention(const AttnArgs& args)
      : a(args),
        query(static_cast<const T*>(args.q)),
        key(static_cast<const T*>(args.k)),
        value(static_cast<const T*>(args.v)),
        out(static_cast<T*>(args.out)),
        lse(static_cast<T*>(args.lse)),
        weights(static_cast<T*>(args.weights)),
        s2(T(args.scale * kLog2e)),
        coff(args.causal == Causal::bottom_right ? args.Lk - args.Lq : 0) {}

  // Keys [0, key_end(i_last)) are visible to queries up to i_last.
  index_t key_end(index_t i_last) const {
    if (a.causal == Causal::none) return a.Lk;
    return max_of<index_t>(0, min_of<index_t>(a.Lk, i_last + coff + 1));
  }

  // ---------------------------------------------------------------- prefill (query tiles)

  // One query panel's state: NR queries, each a column of the transposed tiles. Every buffer
  // has one role; the vectors of per-query statistics are NR long.
  struct Tile {
    T* qt;       // E x NR: the panel's queries, transposed and scaled by s2 (zero beyond nr)
    T* st;       // BK x NR: S^T of the current key block, then P^T in place
    T* acc;      // Ev x NR: the unnormalised output, transposed
    T* m;        // reference per query (log2 units): -inf until a key was visible
    T* l;        // sum of P per query, relative to m
    T* sub;      // exponent offset: m, or 0 where m = -inf (so exp2(-inf - sub) = 0, never NaN)
    T* alpha;    // rescale of l and acc by the last two-pass update
    T* cmax;     // column max of the block's scores (fused path: of S^T - sub)
    T* csum;     // column sums of the block's P^T
    T* inv;      // 1 / l (0 where no key was visible, NaN where l is), once the panel is finished
    bool ready;  // every m is finite: unmasked blocks may take the fused path
    bool fresh;  // no key block taken in yet (l and acc are 0)
    int nr;      // the panel's real queries: kernels compute only the vectors that hold them,
                 // and the rest of st holds finite filler
  };
  static constexpr int kStatVectors = 7;  // m, l, sub, alpha, cmax, csum, inv

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
    T** vecs[kStatVectors] = {&t.m, &t.l, &t.sub, &t.alpha, &t.cmax, &t.csum, &t.inv};
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
    }
    for (index_t x = 0; x < a.Ev * NR; ++x) t.acc[x] = T(0);
    t.ready = false;
    t.fresh = true;
  }

  // acc^T[d, c] *= f[c] for every value column d
  void scale_acc(Tile& t, const T* f) const {
    for (index_t d = 0; d < a.Ev; ++d) {
      T* ad = t.acc + d * NR;
#pragma omp simd
      for (int c = 0; c < NR; ++c) ad[c] *= f[c];
    }
  }

  // qt[e*NR + q] = Q[q0+q, e] * s2, zero beyond the qc real queries.
  PYATTN_PHASE void pack_qt(const T* q, index_t qc, T* qt) const {
    if (qc < NR)
      for (index_t e = 0; e < a.E; ++e)
        for (index_t c = qc; c < NR; ++c) qt[e * NR + c] = T(0);
    K::transpose(q, a.q_rs, qc, a.E, qt, NR);
    for (index_t x = 0; x < a.E * NR; ++x) qt[x] *= s2;
  }

  // s[j*stride] = -inf where key k0+j (j < kb) is hidden from query qi of problem bh (causal
  // or bool mask); an additive mask is added. Shared by the prefill tiles and the decode rows.
  PYATTN_PHASE void mask_row(index_t bh, index_t qi, index_t k0, index_t kb, T* s, index_t stride) const {
    if (a.causal != Causal::none)
      for (index_t j = max_of<index_t>(0, qi + coff + 1 - k0); j < kb; ++j) s[j * stride] = -kInf;
    apply_mask_row(a.mask_kind, a.mask, a.mask_kind == MaskKind::none ? 0 : a.moff[bh] + qi * a.m_rs + k0 * a.m_cs,
                   a.m_cs, kb, s, stride);
  }

  // Whether keys [k0, k0+kb) are all visible to queries from q0 on: no mask, and the block wholly
  // below the diagonal.
  bool unmasked(index_t q0, index_t k0, index_t kb) const {
    return a.mask_kind == MaskKind::none && (a.causal == Causal::none || k0 + kb - 1 <= q0 + coff);
  }

  // S^T blocks of np query panels = K[k0:k0+kb] Q^T, eight keys at a time across all panels so
  // those K rows are read from memory once and from L1 for the other panels; then masked.
  // Panels with fused[p] get P^T = exp2(S^T - sub) straight from the kernel, with colmax(S^T -
  // sub) in cmax and colsum(P^T) in csum (only for unmasked blocks). With `prime` (an unmasked
  // block), a fresh panel takes its references from its first eight keys and the fused path
  // for the rest, fused[p] then set.
  PYATTN_PHASE void scores(index_t bh, index_t q0, index_t k0, index_t kb, Tile* t, int np, bool* fused,
                           bool prime) const {
    const T* kblk = key + a.koff[bh] + k0 * a.k_rs;
    const T* vblk = value + a.voff[bh] + k0 * a.v_rs;
    index_t first[K::NP] = {};  // rows of S^T already computed, per panel
    for (int p = 0; p < np; ++p) {
      if (fused && fused[p])
        for (int c = 0; c < NR; ++c) {
          t[p].cmax[c] = -kInf;
          t[p].csum[c] = T(0);
        }
      if (prime && fused && !fused[p] && t[p].fresh) {
        const int mr = int(min_of<index_t>(MR, kb));
        K::ukernel(mr, a.E, kblk, a.k_rs, 1, t[p].qt, NR, t[p].st, NR, t[p].nr, false);
        fused[p] = prime_panel(mr, t[p]);
        first[p] = MR;
      }
    }
    for (index_t j = 0; j < kb; j += MR) {
      const int mr = int(min_of<index_t>(MR, kb - j));
      prefetch_rows_l2(vblk + j * a.v_rs, a.v_rs, mr, a.Ev);  // this block's V, used next
      for (int p = 0; p < np; ++p) {
        if (j < first[p]) continue;
        if (fused && fused[p])
          K::ukernel_exp2(mr, a.E, kblk + j * a.k_rs, a.k_rs, 1, t[p].qt, NR, t[p].st + j * NR, NR, t[p].nr, t[p].sub,
                          t[p].cmax, t[p].csum);
        else
          K::ukernel(mr, a.E, kblk + j * a.k_rs, a.k_rs, 1, t[p].qt, NR, t[p].st + j * NR, NR, t[p].nr, false);
      }
    }
    if (unmasked(q0, k0, kb)) return;
    for (int p = 0; p < np; ++p) {
      const index_t qp = q0 + p * NR, qc = min_of<index_t>(NR, a.Lq - qp);
      for (index_t c = 0; c < qc; ++c) mask_row(bh, qp + c, k0, kb, t[p].st + c, NR);
    }
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

  // A fresh panel's references from the first mr rows of its first unmasked block:
  //   m = sub = colmax(st[0:mr]); st[0:mr] = exp2(st[0:mr] - m); csum = colsum; cmax = 0
  // Only where every column's max is finite (no -inf/NaN scores); else the block stays raw for
  // the two-pass update. A later key that beats m by the slack sends the block there too.
  static bool prime_panel(int mr, Tile& t) {
    T* cm = t.cmax;
    colmax(t.st, mr, cm);
    bool finite = true;
    for (int c = 0; c < NR; ++c) finite &= cm[c] > -kInf && cm[c] < kInf;
    if (!finite) return false;
    for (int c = 0; c < NR; ++c) {
      t.m[c] = t.sub[c] = cm[c];
      t.cmax[c] = T(0);  // the fused kernel goes on with the max of S^T - sub
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
  PYATTN_PHASE void online_softmax(index_t kb, Tile& t) const {
    T* cm = t.cmax;
    colmax(t.st, kb, cm);
    bool moved = false, ready = true;
    for (int c = 0; c < NR; ++c) {
      T al = T(1);
      if (cm[c] > t.m[c] + kSlack) {
        if (t.m[c] != -kInf) al = T(std::exp2(t.m[c] - cm[c]));
        t.m[c] = cm[c];
      }
      t.alpha[c] = al;
      moved |= al != T(1);
      ready &= t.m[c] != -kInf;
      t.sub[c] = t.m[c] == -kInf ? T(0) : t.m[c];
      t.csum[c] = T(0);
    }
    t.ready = ready;
    for (index_t j = 0; j < kb; ++j) K::exp2_sub_cols(t.st + j * NR, t.sub, t.csum, NR);
#pragma omp simd
    for (int c = 0; c < NR; ++c) t.l[c] = t.alpha[c] * t.l[c] + t.csum[c];
    if (moved) scale_acc(t, t.alpha);
  }

  // After a fused block: l += csum, unless some score exceeded its reference by over kSlack
  // (P may have overflowed): then the block's scores are recomputed and taken the two-pass way.
  PYATTN_PHASE void finish_fused(index_t bh, index_t qp, index_t k0, index_t kb, Tile& t) const {
    bool over = false;
    for (int c = 0; c < NR; ++c) over |= t.cmax[c] > kSlack;
    if (over) {
      scores(bh, qp, k0, kb, &t, 1, nullptr, false);
      online_softmax(kb, t);
      return;
    }
#pragma omp simd
    for (int c = 0; c < NR; ++c) t.l[c] += t.csum[c];
  }

  // acc^T += V_blk^T P^T for every panel, eight value columns at a time across the panels.
  PYATTN_PHASE void accumulate(index_t bh, index_t k0, index_t kb, Tile* t, int np, index_t kend) const {
    const T* vblk = value + a.voff[bh] + k0 * a.v_rs;
    // The next block's K rows, spread over the value-column steps.
    const index_t nnext = min_of<index_t>(BK, kend - k0 - kb),
                  per = ceil_div(nnext, max_of<index_t>(1, ceil_div(a.Ev, MR)));
    const T* knext = key + a.koff[bh] + (k0 + kb) * a.k_rs;
    for (index_t d = 0, r = 0; d < a.Ev; d += MR, r += per) {
      const int mr = int(min_of<index_t>(MR, a.Ev - d));
      if (r < nnext) prefetch_rows_l2(knext + r * a.k_rs, a.k_rs, min_of<index_t>(per, nnext - r), a.E);
      for (int p = 0; p < np; ++p)
        K::ukernel(mr, kb, vblk + d, 1, a.v_rs, t[p].st, NR, t[p].acc + d * NR, NR, t[p].nr, true);
    }
  }

  // Queries [q0, q0 + np*NR) of problem bh: np panels of NR queries share each K/V block.
  void query_group(index_t bh, index_t q0, int np, Tile* t) const {
    np = int(min_of<index_t>(np, ceil_div(a.Lq - q0, NR)));
    const index_t kend = key_end(min_of<index_t>(a.Lq, q0 + np * NR) - 1);
    // The task's Q rows and first K block are asked for together before the Q^T packing starts
    // on them: on short sequences these first touches were a sixth of the time.
    const index_t nq = min_of<index_t>(a.Lq - q0, index_t(np) * NR);
    prefetch_rows_l2(query + a.qoff[bh] + q0 * a.q_rs, a.q_rs, nq, a.E);
    prefetch_rows_l2(key + a.koff[bh], a.k_rs, min_of<index_t>(BK, kend), a.E);
    for (int p = 0; p < np; ++p) {
      const index_t qp = q0 + p * NR, qc = min_of<index_t>(NR, a.Lq - qp);
      pack_qt(query + a.qoff[bh] + qp * a.q_rs, qc, t[p].qt);
      // A short panel: the kernels skip its unused vectors, so give those columns of st a
      // finite filler once (the column statistics run over all NR columns).
      t[p].nr = int(qc);
      if (qc < NR)
        for (index_t j = 0; j < BK; ++j)
          for (index_t c = qc; c < NR; ++c) t[p].st[j * NR + c] = T(0);
      reset_panel(t[p]);
    }
    // Causal: panels before p0 see no key from k0 on and are left out; a block is cut where the
    // first active panel's keys end, so that it computes no row of keys it cannot see.
    int p0 = 0;
    for (index_t k0 = 0, kb = 0; k0 < kend; k0 += kb) {
      while (p0 < np - 1 && key_end(q0 + (p0 + 1) * NR - 1) <= k0) ++p0;
      kb = min_of<index_t>(BK, kend - k0);
      if (p0 < np - 1) kb = min_of<index_t>(kb, max_of<index_t>(MR, key_end(q0 + (p0 + 1) * NR - 1) - k0));
      const index_t qa = q0 + p0 * NR;
      Tile* ta = t + p0;
      const int na = np - p0;
      const bool plain = unmasked(qa, k0, kb);
      bool fused[K::NP];
      for (int p = 0; p < na; ++p) fused[p] = plain && ta[p].ready;
      scores(bh, qa, k0, kb, ta, na, fused, plain);
      for (int p = 0; p < na; ++p) {
        if (fused[p])
          finish_fused(bh, qa + p * NR, k0, kb, ta[p]);
        else
          online_softmax(kb, ta[p]);
        ta[p].fresh = false;
      }
      accumulate(bh, k0, kb, ta, na, kend);
    }
    for (int p = 0; p < np; ++p) finish_panel(bh, q0 + p * NR, kend, t[p]);
  }

  // out = acc / l (zeros where no key was visible), lse = ln(2) * (m + log2(l)); weights if asked.
  PYATTN_PHASE void finish_panel(index_t bh, index_t q0, index_t kend, Tile& t) const {
    const index_t qc = min_of<index_t>(NR, a.Lq - q0);
    T* o = out + a.ooff[bh] + q0 * a.o_rs;
    for (int c = 0; c < NR; ++c) t.inv[c] = inv_of(t.l[c]);
    scale_acc(t, t.inv);
    K::transpose(t.acc, NR, a.Ev, qc, o, a.o_rs);
    if (lse)
      for (index_t c = 0; c < qc; ++c) lse[a.lseoff[bh] + (q0 + c) * a.lse_s] = lse_of(t.m[c], t.l[c]);
    if (weights) weights_panel(bh, q0, qc, kend, t);
  }

  // 1 / l; 0 where no key was visible (l = 0); NaN where l is NaN (a NaN or inf score), so that
  // the weights are NaN wherever the output is, as in the reference.
  static T inv_of(T l) { return l > T(0) ? T(1) / l : l == T(0) ? T(0) : l; }

  static T lse_of(T m, T l) {
    if (!(l > T(0))) return l == T(0) ? -kInf : l;  // no visible key, or NaN
    return T(kLn2) * (m + std::log2(l));
  }

  // Second sweep for return_weights: W[q, j] = exp2(S^T[j, q] - m_q) / l_q, written exactly once.
  PYATTN_PHASE void weights_panel(index_t bh, index_t q0, index_t qc, index_t kend, Tile& t) const {
    const T* inv = t.inv;
    T* w = weights + a.woff[bh] + q0 * a.w_rs;
    for (index_t k0 = 0; k0 < kend; k0 += BK) {
      const index_t kb = min_of<index_t>(BK, kend - k0);
      scores(bh, q0, k0, kb, &t, 1, nullptr, false);
      for (index_t j = 0; j < kb; ++j)
        K::exp2_sub_cols(t.st + j * NR, t.sub, t.csum, NR);  // l is final: csum not needed
      for (index_t c = 0; c < qc; ++c) {
        T* wr = w + c * a.w_rs + k0;
        for (index_t j = 0; j < kb; ++j) wr[j] = t.st[j * NR + c] * inv[c];
      }
    }
  }

  void prefill() const {
    constexpr int NP = K::NP;
    const index_t ngroups = ceil_div(a.Lq, index_t(NP) * NR);
    const index_t ntasks = a.bh * ngroups;
    const std::size_t panel = tile_elems(a.E, a.Ev);
    const double work = double(a.bh) * double(a.Lq) * double(a.Lk) * double(a.E + a.Ev);
    const int nt = int(min_of<index_t>(threads_for(work, a.nthreads), ntasks));
    struct Panels {
      Tile t[NP];
    };
    auto setup = [&] {
      Panels ps;
      T* base = static_cast<T*>(scratch(0, NP * panel * sizeof(T)));
      for (int p = 0; p < NP; ++p) ps.t[p] = carve(base + p * panel);
      return ps;
    };
    team(nt, setup, [&](Panels& ps, const Team& tm) {
      // Causal groups near the end of the sequence do the most work: hand them out first.
      tm.for_each(ntasks, true, [&](index_t i) {
        const index_t g = ngroups - 1 - i / a.bh;
        query_group(i % a.bh, g * NP * NR, NP, ps.t);
      });
    });
  }

  // ---------------------------------------------------------------- decode (few queries)

  static constexpr index_t DB = 64;  // keys per decode block
  // Prefetch distance in blocks: K and V rows this far ahead are asked for one per key. With
  // none, one core streamed at ~70% of its rate for a plain sum; 1 and 2 measured the same.
  static constexpr index_t PFD = 1;

  // Rows of a decode task: all Lq queries of the `group` heads that share one K/V.
  struct Rows {
    index_t R;
    T *q, *s, *acc, *m, *l;
  };

  static std::size_t decode_scratch(index_t R, index_t E, index_t Ev) {
    return std::size_t(R) * std::size_t(E + DB + Ev + 2) * sizeof(T);
  }

  // Runs keys [j0, j1) of head group g; leaves unnormalised acc, running max m (log2 units)
  // and sum l per row.
  PYATTN_PHASE void decode_chunk(index_t g, index_t j0, index_t j1, Rows& r) const {
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
    const T* kbase = key + a.koff[h0];
    const T* vbase = value + a.voff[h0];
    for (index_t k0 = j0; k0 < j1; k0 += DB) {
      const index_t kb = min_of<index_t>(DB, j1 - k0);
      // s[x, j] = q_x . k_j, key rows read in order (see kernels/x86_simd.h). Prefetched, one
      // row per key: this block's V (for pv_rows below), and K and V PFD blocks ahead, so that
      // neither stream starts cold at a block boundary.
      for (index_t j = 0; j < kb; ++j) {
        const T* kr = kbase + (k0 + j) * a.k_rs;
        prefetch_rows_l2(vbase + (k0 + j) * a.v_rs, a.v_rs, 1, Ev);
        if (k0 + PFD * DB + j < j1) {
          prefetch_rows_l2(kr + PFD * DB * a.k_rs, a.k_rs, 1, E);
          prefetch_rows_l2(vbase + (k0 + PFD * DB + j) * a.v_rs, a.v_rs, 1, Ev);
        }
        K::dot_rows(r.q, E, r.R, kr, E, r.s + j, DB);
      }
      for (index_t x = 0; x < r.R; ++x) {
        const index_t h = h0 + x / Lq, qi = x % Lq;
        T* s = r.s + x * DB;
        mask_row(h, qi, k0, kb, s, 1);
        T mx = r.m[x];
        for (index_t j = 0; j < kb; ++j) mx = s[j] > mx ? s[j] : mx;
        const T sub = mx == -kInf ? T(0) : mx;
        const T alpha = r.m[x] == -kInf ? T(0) : T(std::exp2(r.m[x] - sub));
        r.m[x] = mx;
        r.l[x] = alpha * r.l[x] + K::exp2_sub_sum(s, kb, sub);
        if (alpha != T(1)) {
          T* ax = r.acc + x * Ev;
#pragma omp simd
          for (index_t d = 0; d < Ev; ++d) ax[d] *= alpha;
        }
      }
      // acc_x += sum_j p[x, j] v_j, the accumulator chunk held in registers over the block
      K::pv_rows(r.s, DB, r.R, kb, vbase + k0 * a.v_rs, a.v_rs, Ev, r.acc);
    }
  }

  void finish_row(index_t g, index_t x, const T* acc, T m, T l) const {
    const index_t h = g * a.group + x / a.Lq, qi = x % a.Lq;
    T* orow = out + a.ooff[h] + qi * a.o_rs;
    const T inv = inv_of(l);
    for (index_t d = 0; d < a.Ev; ++d) orow[d] = acc[d] * inv;
    if (lse) lse[a.lseoff[h] + qi * a.lse_s] = lse_of(m, l);
  }

  void decode() const {
    const index_t ng = a.bh / a.group, R = a.group * a.Lq, Ev = a.Ev;
    // Key chunks: enough tasks to feed 8 threads, never under 256 keys. The split does not
    // depend on the thread count, so results are identical for any number of threads.
    index_t nchunk = 1;
    if (ng < 8) nchunk = max_of<index_t>(1, min_of<index_t>(ceil_div(8, ng), a.Lk / 256));
    const index_t chunk = round_up(ceil_div(a.Lk, nchunk), DB);
    nchunk = max_of<index_t>(1, ceil_div(a.Lk, chunk));
    const index_t ntasks = ng * nchunk;
    const std::size_t part = std::size_t(R) * std::size_t(Ev + 2);  // acc, m, l per task
    T* parts = nchunk > 1 ? static_cast<T*>(scratch(2, ntasks * part * sizeof(T))) : nullptr;
    const std::size_t bytes = decode_scratch(R, a.E, Ev);
    const double work = double(a.bh) * double(a.Lq) * double(a.Lk) * double(a.E + a.Ev);
    const int nt = int(min_of<index_t>(threads_for(work, a.nthreads), ntasks));

    auto task = [&](index_t t, Rows& r) {
      const index_t g = t / nchunk, c = t % nchunk;
      const index_t j0 = c * chunk, j1 = min_of<index_t>(a.Lk, j0 + chunk);
      const index_t jend = min_of<index_t>(j1, key_end(a.Lq - 1));
      decode_chunk(g, j0, max_of<index_t>(j0, jend), r);
      if (!parts) {
        for (index_t x = 0; x < R; ++x) finish_row(g, x, r.acc + x * Ev, r.m[x], r.l[x]);
        return;
      }
      T* p = parts + t * part;
      for (index_t x = 0; x < R * Ev; ++x) p[x] = r.acc[x];
      for (index_t x = 0; x < R; ++x) {
        p[R * Ev + x] = r.m[x];
        p[R * Ev + R + x] = r.l[x];
      }
    };
    auto carve_rows = [&](T* base) {
      Rows r;
      r.R = R;
      r.q = base;
      r.s = r.q + R * a.E;
      r.acc = r.s + R * DB;
      r.m = r.acc + R * Ev;
      r.l = r.m + R;
      return r;
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
          const T* p = parts + (g * nchunk + c) * part;
          const T mc = p[R * Ev + x];
          const T w = mc == -kInf ? T(0) : T(std::exp2(mc - sub));
          l += w * p[R * Ev + R + x];
          for (index_t d = 0; d < Ev; ++d) acc[d] += w * p[x * Ev + d];
        }
        finish_row(g, x, acc, M, l);
      }
    };

    team(
        nt, [&] { return carve_rows(static_cast<T*>(scratch(0, bytes))); },
        [&](Rows& r, const Team& tm) {
          tm.for_each(ntasks, true, [&](index_t t) { task(t, r); });
          if (parts) tm.for_each(ng, false, [&](index_t g) { merge(g, r.acc); });
        });
  }

  // Decode when each K/V row would otherwise be read for a single query tile that is mostly
  // padding: few queries per head group, and no weights asked for.
  static bool use_decode(const AttnArgs& args) { return !args.weights && args.Lq * args.group <= 16 && args.Lq <= 8; }

  static void run(const AttnArgs& args) {
    if (args.bh == 0 || args.Lq == 0) return;
    Attention self(args);
    if (use_decode(args))
      self.decode();
    else
      self.prefill();
  }
};
