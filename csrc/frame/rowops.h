// Row-streaming helpers for the decode path, written once over a per-ISA vector `Ops` type
// (load/maskload/store/maskstore/set1/fma and a lane mask) and instantiated in each ISA's
// translation unit, inside its namespace.
#pragma once

// Decode helpers. Both read every K and V row front to back, one row after the other: that
// order streams at memory speed, where reading several rows side by side (column-wise within
// a block) confuses the prefetchers and runs at a third of it.

//   acc[x, d] += sum_j p[x*ps + j] * v[j*v_rs + d], for an NV-vector (W = NV*L) column chunk
//   kept in registers across all kb rows.
template <class T, class V, int L, int NV, class Ops>
static inline void pv_chunk(const T* p, index_t ps, index_t R, index_t kb, const T* v, index_t v_rs, int w,
                            T* acc, index_t ldacc) {
  const typename Ops::Mask last = Ops::mask(w - (NV - 1) * L);
  for (index_t x = 0; x < R; ++x) {
    V a[NV];
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) a[i] = i < NV - 1 ? Ops::load(acc + x * ldacc + i * L) : Ops::maskload(last, acc + x * ldacc + i * L);
    const T* px = p + x * ps;
    for (index_t j = 0; j < kb; ++j) {
      const V pj = Ops::set1(px[j]);
      const T* vr = v + j * v_rs;
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i)
        a[i] = Ops::fma(pj, i < NV - 1 ? Ops::load(vr + i * L) : Ops::maskload(last, vr + i * L), a[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      if (i < NV - 1)
        Ops::store(acc + x * ldacc + i * L, a[i]);
      else
        Ops::maskstore(last, acc + x * ldacc + i * L, a[i]);
    }
  }
}

template <class T, class V, int L, class Ops>
static inline void pv_rows_impl(const T* p, index_t ps, index_t R, index_t kb, const T* v, index_t v_rs, index_t Ev,
                                T* acc) {
  for (index_t d0 = 0; d0 < Ev; d0 += 8 * L) {
    const int w = int(Ev - d0 < 8 * L ? Ev - d0 : 8 * L);
    switch ((w + L - 1) / L) {
      case 8: pv_chunk<T, V, L, 8, Ops>(p, ps, R, kb, v + d0, v_rs, w, acc + d0, Ev); break;
      case 7: pv_chunk<T, V, L, 7, Ops>(p, ps, R, kb, v + d0, v_rs, w, acc + d0, Ev); break;
      case 6: pv_chunk<T, V, L, 6, Ops>(p, ps, R, kb, v + d0, v_rs, w, acc + d0, Ev); break;
      case 5: pv_chunk<T, V, L, 5, Ops>(p, ps, R, kb, v + d0, v_rs, w, acc + d0, Ev); break;
      case 4: pv_chunk<T, V, L, 4, Ops>(p, ps, R, kb, v + d0, v_rs, w, acc + d0, Ev); break;
      case 3: pv_chunk<T, V, L, 3, Ops>(p, ps, R, kb, v + d0, v_rs, w, acc + d0, Ev); break;
      case 2: pv_chunk<T, V, L, 2, Ops>(p, ps, R, kb, v + d0, v_rs, w, acc + d0, Ev); break;
      default: pv_chunk<T, V, L, 1, Ops>(p, ps, R, kb, v + d0, v_rs, w, acc + d0, Ev); break;
    }
  }
}

