// BLIS-style packed GEMM, written once and instantiated per ISA with that ISA's kernel traits.
//
// Loops (C is row-major in practice, so the micro-kernel vectorises along n):
//   for pc over k in KC blocks:          pack A (m x kc) in MR-row panels and B (kc x n) in
//                                         NR-column panels: the operand the threads share is
//                                         packed by all of them, the other by each for itself
//     for each block (MC x NC) of the thread's rectangle of panels (NC x KC of packed B in L2)
//       for ir in MR panels (A micro-panel resident in L1 across the jr loop)
//         for jr in NR panels:           ukernel: C[MR x NR] (+)= A_panel[MR x kc] B_panel[kc x NR]
// Few-row products (m <= 4) take the unpacked gemv path instead.
// Kernel traits K provide T, MR, NR, MC, KC, NC, ukernel() and transpose(); see csrc/kernels/<isa>/.
#pragma once

template <class K>
struct Gemm {
  using T = typename K::T;
  static constexpr int MR = K::MR, NR = K::NR;

  // dst[p*MR + r] = a[r*rsa + p*csa] for r < rows; rows rows..MR-1 are zero.
  static void pack_a(const T* a, index_t rsa, index_t csa, int rows, index_t kc, T* dst) {
    if (csa == 1) {
      K::transpose(a, rsa, rows, kc, dst, MR);
    } else {
      for (index_t p = 0; p < kc; ++p)
        for (int r = 0; r < rows; ++r) dst[p * MR + r] = a[r * rsa + p * csa];
    }
    if (rows < MR)
      for (index_t p = 0; p < kc; ++p)
        for (int r = rows; r < MR; ++r) dst[p * MR + r] = T(0);
  }

  // dst[p*NR + j] = b[p*rsb + j*csb] for j < cols; columns cols..NR-1 are zero.
  static void pack_b(const T* b, index_t rsb, index_t csb, int cols, index_t kc, T* dst) {
    if (csb == 1 && cols == NR) {
      for (index_t p = 0; p < kc; ++p) {
        const T* bp = b + p * rsb;
        T* d = dst + p * NR;
        for (int j = 0; j < NR; ++j) d[j] = bp[j];
      }
      return;
    }
    if (csb == 1) {
      for (index_t p = 0; p < kc; ++p) {
        const T* bp = b + p * rsb;
        T* d = dst + p * NR;
        for (int j = 0; j < cols; ++j) d[j] = bp[j];
        for (int j = cols; j < NR; ++j) d[j] = T(0);
      }
      return;
    }
    for (int j = 0; j < cols; ++j) {
      const T* bj = b + j * csb;
      for (index_t p = 0; p < kc; ++p) dst[p * NR + j] = bj[p * rsb];
    }
    for (index_t p = 0; p < kc; ++p)
      for (int j = cols; j < NR; ++j) dst[p * NR + j] = T(0);
  }

  // C tile (+)= packed A panel x packed B panel; C may have any column stride.
  static void tile(index_t kc, const T* ap, const T* bp, T* c, index_t rsc, index_t csc, int mr, int nr,
                   bool accumulate) {
    if (csc == 1) {
      K::ukernel(mr, kc, ap, 1, MR, bp, NR, c, rsc, nr, accumulate);
      return;
    }
    alignas(64) T buf[MR * NR];
    K::ukernel(mr, kc, ap, 1, MR, bp, NR, buf, NR, nr, false);
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < nr; ++j) {
        T& dst = c[r * rsc + j * csc];
        dst = accumulate ? dst + buf[r * NR + j] : buf[r * NR + j];
      }
  }

  static constexpr index_t kDirectMaxN = 64;

  // How evenly `total` rows (or columns), in panels of `width`, split over nt threads: the mean
  // share over the busiest thread's (1: even). Nine column panels of (333, 517, 129) split 5 / 4,
  // the last one a single column: 0.81, where its 56 row panels split 0.98.
  static double balance(index_t panels, index_t width, index_t total, int nt) {
    // split_range gives the first threads the extra panels, all whole: the first is the busiest
    return double(total) / (double(nt) * double(min_of<index_t>(total, ceil_div(panels, index_t(nt)) * width)));
  }

  // One matrix, run by thread `tid` of a team of `nt` (nt == 1: no barriers).
  // ap, bp: shared packing buffers of at least round_up(m,MR)*KC and KC*round_up(n,NR) elements.
  static void body(const T* a, index_t rsa, index_t csa, const T* b, index_t rsb, index_t csb, T* c, index_t rsc,
                   index_t csc, index_t m, index_t n, index_t k, int tid, int nt, T* ap, T* bp) {
    const index_t npa = ceil_div(m, MR), npb = ceil_div(n, NR);
    // Each thread takes a rectangle of whole panels: a run of NR-column panels when there are
    // enough of them, else a run of MR-row panels. The operand the threads share is packed by
    // all of them in equal parts; the other one each thread packs for itself, only its own
    // panels, so packing stays balanced and needs no second barrier. One thread splits nothing,
    // and takes the row order: A packed block by block (or read in place when narrow), not all
    // of it up front and read back from L3 (AVX2 (4096, 4096, 64): 0.71 of the time).
    index_t r0 = 0, r1 = npa, c0 = 0, c1 = npb;
    const bool split_cols =
        nt > 1 && (npb >= 4 * nt || npb >= npa) && balance(npb, NR, n, nt) + 0.05 >= balance(npa, MR, m, nt);
    // Narrow products (n <= kDirectMaxN): each A micro-panel would serve a few tiles only, and
    // packing it (a transpose) cost more than it saved. The micro-kernel then reads the thread's
    // A rows where they lie, as attention reads K rows (A/B, AVX2 and AVX-512, 1 and 2 threads:
    // 0.16-0.89 of the packed path's time on n = 16..64, one shape at 1.10).
    const bool direct_a = !split_cols && csa == 1 && csc == 1 && n <= kDirectMaxN;
    if (nt > 1) {
      if (split_cols)
        split_range(npb, tid, nt, c0, c1);
      else
        split_range(npa, tid, nt, r0, r1);
    }
    auto pack_a_panels = [&](index_t pc, index_t kc, index_t i0, index_t i1) {
      for (index_t i = i0; i < i1; ++i)
        pack_a(a + i * MR * rsa + pc * csa, rsa, csa, int(min_of<index_t>(MR, m - i * MR)), kc, ap + i * MR * kc);
    };
    auto pack_b_panels = [&](index_t pc, index_t kc, index_t j0, index_t j1) {
      for (index_t j = j0; j < j1; ++j)
        pack_b(b + pc * rsb + j * NR * csb, rsb, csb, int(min_of<index_t>(NR, n - j * NR)), kc, bp + j * NR * kc);
    };
    for (index_t pc = 0; pc < k; pc += K::KC) {
      const index_t kc = min_of<index_t>(K::KC, k - pc);
      index_t s0, s1;
      if (split_cols) {
        split_range(npa, tid, nt, s0, s1);
        pack_a_panels(pc, kc, s0, s1);
        pack_b_panels(pc, kc, c0, c1);
      } else {  // the thread's own A panels are packed block by block below, just before use
        split_range(npb, tid, nt, s0, s1);
        pack_b_panels(pc, kc, s0, s1);
      }
      if (nt > 1) {
#pragma omp barrier
      }
      constexpr index_t mcp = K::MC / MR, ncp = K::NC / NR;  // block sizes in panels
      for (index_t jb = c0; jb < c1; jb += ncp) {
        const index_t je = min_of<index_t>(c1, jb + ncp);
        for (index_t ib = r0; ib < r1; ib += mcp) {
          const index_t ie = min_of<index_t>(r1, ib + mcp);
          // Packed on the first column block, this MC x KC block is still in L2 for its tiles
          // (all of A packed up front was read back from L3: 0.8x OpenBLAS at n = 64).
          if (!split_cols && jb == c0 && !direct_a) pack_a_panels(pc, kc, ib, ie);
          for (index_t ip = ib; ip < ie; ++ip) {
            const int mr = int(min_of<index_t>(MR, m - ip * MR));
            const T* apanel = ap + ip * MR * kc;
            for (index_t jp = jb; jp < je; ++jp) {
              const int nr = int(min_of<index_t>(NR, n - jp * NR));
              T* ct = c + ip * MR * rsc + jp * NR * csc;
              if (direct_a)
                K::ukernel(mr, kc, a + ip * MR * rsa + pc, rsa, 1, bp + jp * NR * kc, NR, ct, rsc, nr, pc > 0);
              else
                tile(kc, apanel, bp + jp * NR * kc, ct, rsc, csc, mr, nr, pc > 0);
            }
          }
        }
      }
      if (nt > 1) {
#pragma omp barrier
      }
    }
  }

  // Few rows of A against a row-major B (x @ W in decode): memory bound, so B is streamed once,
  // row after row, with no packing. The k rows are cut into at most kGemvChunks fixed chunks
  // (the same for any thread count, so results do not depend on it); each chunk reads whole
  // rows of B, the hardware prefetcher's best case, into its own partial sums, which are then
  // added in chunk order.
  //   part[ch, i, :] = sum_{p in chunk ch} a[i, p] * b[p, :];  c[i, :] = sum_ch part[ch, i, :]
  static constexpr index_t kGemvRows = 4, kGemvChunks = 8, kGemvMinChunk = 128;
  static void gemv_chunk(const T* a, index_t rsa, index_t csa, const T* b, index_t rsb, index_t m, index_t n,
                         index_t p0, index_t p1, T* part) {
    for (index_t x = 0; x < m * n; ++x) part[x] = T(0);
    // Four rows of B per pass over the partial sums: one read-modify-write of acc per four
    // streamed rows keeps the loop at memory speed (a row at a time reaches ~60% of it).
    index_t p = p0;
    for (; p + 4 <= p1; p += 4) {
      const T* b0 = b + p * rsb;
      const T *b1 = b0 + rsb, *b2 = b1 + rsb, *b3 = b2 + rsb;
      for (index_t i = 0; i < m; ++i) {
        const T* ai = a + i * rsa + p * csa;
        const T a0 = ai[0], a1 = ai[csa], a2 = ai[2 * csa], a3 = ai[3 * csa];
        T* acc = part + i * n;
#pragma omp simd
        for (index_t j = 0; j < n; ++j) acc[j] += a0 * b0[j] + a1 * b1[j] + a2 * b2[j] + a3 * b3[j];
      }
    }
    for (; p < p1; ++p) {
      const T* bp = b + p * rsb;
      for (index_t i = 0; i < m; ++i) {
        const T av = a[i * rsa + p * csa];
        T* acc = part + i * n;
#pragma omp simd
        for (index_t j = 0; j < n; ++j) acc[j] += av * bp[j];
      }
    }
  }
  static void gemv_reduce(const T* part, index_t nch, index_t m, index_t n, T* c, index_t rsc, index_t csc, index_t j0,
                          index_t j1) {
    for (index_t i = 0; i < m; ++i)
      for (index_t j = j0; j < j1; ++j) {
        T s = part[i * n + j];
        for (index_t ch = 1; ch < nch; ++ch) s += part[(ch * m + i) * n + j];
        c[i * rsc + j * csc] = s;
      }
  }
  static void gemv(const T* a, index_t rsa, index_t csa, const T* b, index_t rsb, T* c, index_t rsc, index_t csc,
                   index_t m, index_t n, index_t k, int nthreads) {
    const index_t nch = max_of<index_t>(1, min_of<index_t>(kGemvChunks, k / kGemvMinChunk));
    const index_t chunk = ceil_div(k, nch);
    T* part = static_cast<T*>(scratch(2, std::size_t(nch * m * n) * sizeof(T)));
    const int nt = int(min_of<index_t>(nthreads, nch));
    team(nt, no_state, [&](int, const Team& tm) {
      tm.for_each(nch, false, [&](index_t ch) {
        gemv_chunk(a, rsa, csa, b, rsb, m, n, ch * chunk, min_of<index_t>(k, (ch + 1) * chunk), part + ch * m * n);
      });
      index_t j0, j1;  // after the loop's closing barrier: every chunk is done
      split_range(n, tm.tid(), tm.size(), j0, j1);
      gemv_reduce(part, nch, m, n, c, rsc, csc, j0, j1);
    });
  }

  static void zero(T* c, index_t rsc, index_t csc, index_t m, index_t n) {
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j) c[i * rsc + j * csc] = T(0);
  }

  static void run(const GemmArgs& g) {
    const T* A = static_cast<const T*>(g.a);
    const T* B = static_cast<const T*>(g.b);
    T* C = static_cast<T*>(g.c);
    const index_t m = g.m, n = g.n, k = g.k;
    auto off = [](const index_t* o, index_t i) { return o ? o[i] : index_t(0); };
    if (m == 0 || n == 0 || g.batch == 0) return;
    if (k == 0) {
      for (index_t bi = 0; bi < g.batch; ++bi) zero(C + off(g.offc, bi), g.rsc, g.csc, m, n);
      return;
    }
    const double per = double(m) * double(n) * double(k);
    const int nt_all = threads_for(per * double(g.batch), g.nthreads);

    if (m <= kGemvRows && g.csb == 1) {
      for (index_t bi = 0; bi < g.batch; ++bi)
        gemv(A + off(g.offa, bi), g.rsa, g.csa, B + off(g.offb, bi), g.rsb, C + off(g.offc, bi), g.rsc, g.csc, m, n, k,
             threads_for(per, g.nthreads));
      return;
    }

    const index_t kc = min_of<index_t>(k, K::KC);
    const std::size_t asz = std::size_t(round_up(m, MR) * kc), bsz = std::size_t(kc * round_up(n, NR));
    // Many small products: one per thread, each with its own packing buffers.
    if (g.batch >= 2 * nt_all && nt_all > 1 && per < 64.0 * 64 * 64 * 64) {
      struct Bufs {
        T *ap, *bp;
      };
      team(
          nt_all,
          [&] {
            return Bufs{static_cast<T*>(scratch(0, asz * sizeof(T))), static_cast<T*>(scratch(1, bsz * sizeof(T)))};
          },
          [&](const Bufs& buf, const Team& tm) {
            tm.for_each(g.batch, true, [&](index_t bi) {
              body(A + off(g.offa, bi), g.rsa, g.csa, B + off(g.offb, bi), g.rsb, g.csb, C + off(g.offc, bi), g.rsc,
                   g.csc, m, n, k, 0, 1, buf.ap, buf.bp);
            });
          });
      return;
    }
    // One product at a time, its packing buffers shared by the team.
    T* ap = static_cast<T*>(scratch(0, asz * sizeof(T)));
    T* bp = static_cast<T*>(scratch(1, bsz * sizeof(T)));
    const int nt = threads_for(per, g.nthreads);
    for (index_t bi = 0; bi < g.batch; ++bi) {
      const T* a = A + off(g.offa, bi);
      const T* b = B + off(g.offb, bi);
      T* c = C + off(g.offc, bi);
      team(nt, no_state, [&](int, const Team& tm) {
        body(a, g.rsa, g.csa, b, g.rsb, g.csb, c, g.rsc, g.csc, m, n, k, tm.tid(), tm.size(), ap, bp);
      });
    }
  }
};
