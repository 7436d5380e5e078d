// Every kernel set this target can run (generic and neon on AArch64; generic, avx2 and avx512 on
// x86 as far as the CPU has them) against a plain double-precision reference written here, over
// many shapes: GEMM (strides, batches, block edges), softmax (masks, strides) and attention
// (odd sizes and tile edges, causal in both alignments, masks, window, softcap, ALiBi, sinks,
// kv_lens, q_lens, paged K/V, float16 / bfloat16 / int8 K/V, LSE and weights, prefill and decode,
// one and two threads). Linked straight against the frame and the kernel sets (no Python), so it
// runs under qemu-user for a cross-compiled target: tools/cross_aarch64.sh, tests/cpp/CMakeLists.txt.
//   test_kernels [--quick] [--expect-default NAME [--dispatch-only]]
// --expect-default checks the set dispatch picks on its own (PYATTN_ISA is honoured there);
// --dispatch-only stops after that check.
// Ends with "N passed, N failed"; exits non-zero on any failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "frame/api.h"

using namespace pyattn;

namespace {

int g_passed = 0, g_failed = 0;
constexpr double kInf = std::numeric_limits<double>::infinity();

// One comparison: pass or print what differs (the first few failures in full).
void check(bool ok, const std::string& what) {
  if (ok) {
    ++g_passed;
    return;
  }
  ++g_failed;
  if (g_failed <= 30) std::printf("FAIL %s\n", what.c_str());
}

template <class T>
struct Tol;
template <>
struct Tol<float> {
  static constexpr double eps = 5.96e-8, atol = 4e-5, rtol = 4e-4;
  static const char* name() { return "f32"; }
};
template <>
struct Tol<double> {
  static constexpr double eps = 1.12e-16, atol = 1e-10, rtol = 1e-9;
  static const char* name() { return "f64"; }
};

bool same(double got, double ref, double atol, double rtol) {
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isinf(ref)) return got == ref;
  return std::fabs(got - ref) <= atol + rtol * std::fabs(ref);
}

// The first value out of tolerance, or else the largest difference (NaN and inf must match).
struct Diff {
  bool ok = true;
  double worst = -1;
  std::size_t at = 0;
  double got = 0, ref = 0;
};
template <class G, class R, class Tolf>
Diff compare(std::size_t n, G&& got, R&& ref, Tolf&& tol_ok) {
  Diff d;
  for (std::size_t i = 0; i < n; ++i) {
    const double g = got(i), r = ref(i);
    if (!tol_ok(i, g, r)) return Diff{false, std::fabs(g - r), i, g, r};
    const double e = std::isfinite(r) ? std::fabs(g - r) : 0.0;
    if (e > d.worst) d = Diff{true, e, i, g, r};
  }
  return d;
}
std::string describe(const Diff& d) {
  char buf[160];
  std::snprintf(buf, sizeof buf, " [at %zu: got %.9g, want %.9g]", d.at, d.got, d.ref);
  return buf;
}

struct Rng {
  std::mt19937_64 g;
  explicit Rng(std::uint64_t seed) : g(seed) {}
  double uniform(double a, double b) { return std::uniform_real_distribution<double>(a, b)(g); }
  int integer(int a, int b) { return std::uniform_int_distribution<int>(a, b)(g); }
  bool chance(double p) { return uniform(0, 1) < p; }
};

// ------------------------------------------------------------------ kernel sets
struct KernelSet {
  std::string name;
  const IsaTable* table;
};
std::vector<KernelSet> kernel_sets() {
  std::vector<KernelSet> out;
  for (const char* n : {"generic", "avx2", "avx512", "neon"})
    if (isa_supported(n) && set_active_isa(n)) out.push_back({n, &active_isa()});
  return out;
}

// ------------------------------------------------------------------ GEMM
template <class T>
void test_gemm(const std::vector<KernelSet>& sets, Rng& rng, int m, int n, int k, bool ta, bool tb, int csc, int batch,
               int threads) {
  const index_t rsa = ta ? 1 : k, csa = ta ? m : 1, rsb = tb ? 1 : n, csb = tb ? k : 1, rsc = index_t(n) * csc;
  const index_t sa = index_t(m) * k + 3, sb = index_t(k) * n + 5, sc = index_t(m) * rsc + 7;  // gaps between batches
  std::vector<T> A(sa * batch), B(sb * batch);
  for (auto& x : A) x = T(rng.uniform(-1, 1));
  for (auto& x : B) x = T(rng.uniform(-1, 1));
  std::vector<index_t> offa(batch), offb(batch), offc(batch);
  for (int b = 0; b < batch; ++b) offa[b] = b * sa, offb[b] = b * sb, offc[b] = b * sc;
  std::vector<double> ref(sc * batch, 777.0), bound(sc * batch, 0.0);
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double s = 0, sabs = 0;
        for (int p = 0; p < k; ++p) {
          const double x = A[offa[b] + i * rsa + p * csa], y = B[offb[b] + p * rsb + j * csb];
          s += x * y;
          sabs += std::fabs(x * y);
        }
        ref[offc[b] + i * rsc + j * csc] = s;
        bound[offc[b] + i * rsc + j * csc] = Tol<T>::eps * (k + 4) * sabs + 1e-30;
      }
  for (const KernelSet& ks : sets) {
    std::vector<T> C(sc * batch, T(777));  // positions outside C (gaps, csc > 1) must keep it
    GemmArgs g{m,        n,   k,   A.data(), rsa,         csa,         B.data(),    rsb,    csb,
               C.data(), rsc, csc, batch,    offa.data(), offb.data(), offc.data(), threads};
    ks.table->gemm[sizeof(T) == 8](g);
    const Diff d = compare(
        C.size(), [&](std::size_t i) { return double(C[i]); }, [&](std::size_t i) { return ref[i]; },
        [&](std::size_t i, double got, double want) { return std::fabs(got - want) <= bound[i]; });
    char what[200];
    std::snprintf(what, sizeof what, "%s gemm %s m=%d n=%d k=%d ta=%d tb=%d csc=%d batch=%d threads=%d",
                  ks.name.c_str(), Tol<T>::name(), m, n, k, ta, tb, csc, batch, threads);
    check(d.ok, what + describe(d));
  }
}

// ------------------------------------------------------------------ softmax
template <class T>
void test_softmax(const std::vector<KernelSet>& sets, Rng& rng, int rows, int n, int xcs, int ocs, MaskKind mk, int mcs,
                  double scale, int threads) {
  std::vector<T> X(std::size_t(rows) * n * xcs);
  for (auto& x : X) x = T(rng.uniform(-4, 4));
  std::vector<index_t> xoff(rows), ooff(rows), moff(rows);
  const index_t mrow = mcs ? n : 1;
  for (int r = 0; r < rows; ++r) xoff[r] = index_t(r) * n * xcs, ooff[r] = index_t(r) * n * ocs, moff[r] = r * mrow;
  std::vector<unsigned char> mb(std::size_t(rows) * mrow);
  std::vector<T> ma(std::size_t(rows) * mrow);
  for (std::size_t i = 0; i < mb.size(); ++i) {
    mb[i] = rng.chance(0.8);
    ma[i] = rng.chance(0.1) ? -std::numeric_limits<T>::infinity() : T(rng.uniform(-3, 1));
  }
  if (rows > 1 && mk == MaskKind::boolean)  // one fully masked row: zeros
    for (index_t j = 0; j < mrow; ++j) mb[std::size_t(rows - 1) * mrow + j] = 0;
  const void* mask = mk == MaskKind::boolean ? static_cast<const void*>(mb.data()) : ma.data();
  std::vector<double> ref(std::size_t(rows) * n * ocs, 555.0);
  for (int r = 0; r < rows; ++r) {
    std::vector<double> y(n);
    double mx = -kInf;
    for (int j = 0; j < n; ++j) {
      y[j] = double(X[xoff[r] + j * xcs]) * double(T(scale));
      const std::size_t mi = std::size_t(moff[r]) + std::size_t(j) * mcs;
      if (mk == MaskKind::boolean && !mb[mi]) y[j] = -kInf;
      if (mk == MaskKind::additive) y[j] += double(ma[mi]);
      mx = std::max(mx, y[j]);
    }
    double s = 0;
    for (int j = 0; j < n; ++j) s += mx == -kInf ? 0 : std::exp(y[j] - mx);
    for (int j = 0; j < n; ++j) ref[ooff[r] + j * ocs] = mx == -kInf ? 0.0 : std::exp(y[j] - mx) / s;
  }
  for (const KernelSet& ks : sets) {
    std::vector<T> O(ref.size(), T(555));
    SoftmaxArgs a{rows,
                  n,
                  X.data(),
                  xoff.data(),
                  xcs,
                  O.data(),
                  ooff.data(),
                  ocs,
                  mk,
                  mk == MaskKind::none ? nullptr : mask,
                  mk == MaskKind::none ? nullptr : moff.data(),
                  mcs,
                  scale,
                  threads};
    ks.table->softmax[sizeof(T) == 8](a);
    const Diff d = compare(
        O.size(), [&](std::size_t i) { return double(O[i]); }, [&](std::size_t i) { return ref[i]; },
        [&](std::size_t, double got, double want) { return same(got, want, Tol<T>::atol * 0.1, Tol<T>::rtol * 0.1); });
    char what[200];
    std::snprintf(what, sizeof what, "%s softmax %s rows=%d n=%d xcs=%d ocs=%d mask=%d mcs=%d threads=%d",
                  ks.name.c_str(), Tol<T>::name(), rows, n, xcs, ocs, int(mk), mcs, threads);
    check(d.ok, what + describe(d));
  }
}

// ------------------------------------------------------------------ attention
enum class KV { same = 0, f16 = 1, bf16 = 2, i8 = 3 };
const char* kv_name(KV k) { return k == KV::same ? "float" : k == KV::f16 ? "f16" : k == KV::bf16 ? "bf16" : "int8"; }

struct Case {
  int bh = 1, group = 1, Lq = 1, Lk = 1, E = 8, Ev = 8;
  bool causal = false, bottom_right = false;
  MaskKind mask = MaskKind::none;
  double scale = 0, softcap = 0;
  bool alibi = false, sinks = false, kv_lens = false, q_lens = false, lse = false, weights = false;
  index_t wl = kNoLimit, wr = kNoLimit;
  int block_size = 0;  // paged when > 0
  KV kv = KV::same;
  int pad = 0;  // extra elements at the end of every q, k, v and output row
  int threads = 1;
};

std::string describe(const Case& c) {
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "bh=%d group=%d Lq=%d Lk=%d E=%d Ev=%d causal=%d br=%d mask=%d scale=%g softcap=%g alibi=%d "
                "sinks=%d kv_lens=%d q_lens=%d lse=%d weights=%d window=(%lld,%lld) paged=%d kv=%s pad=%d threads=%d",
                c.bh, c.group, c.Lq, c.Lk, c.E, c.Ev, c.causal, c.bottom_right, int(c.mask), c.scale, c.softcap,
                c.alibi, c.sinks, c.kv_lens, c.q_lens, c.lse, c.weights, (long long)(c.wl == kNoLimit ? -1 : c.wl),
                (long long)(c.wr == kNoLimit ? -1 : c.wr), c.block_size, kv_name(c.kv), c.pad, c.threads);
  return buf;
}

// Exact encodings of values the test picks to be representable: float16 (normal or subnormal)
// and bfloat16 (a float's top half).
std::uint16_t f16_bits(double x) {
  if (x == 0) return std::signbit(x) ? 0x8000 : 0;
  const std::uint16_t sign = x < 0 ? 0x8000 : 0;
  double a = std::fabs(x);
  int e;
  const double fr = std::frexp(a, &e);  // a = fr * 2^e, fr in [0.5, 1)
  if (e - 1 >= -14) return std::uint16_t(sign | ((e - 1 + 15) << 10) | int(std::ldexp(fr * 2 - 1, 10)));
  return std::uint16_t(sign | int(std::ldexp(a, 24)));
}
std::uint16_t bf16_bits(double x) {
  const float f = float(x);
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return std::uint16_t(u >> 16);
}

// A value the storage holds exactly: K/V of float16 / bfloat16 are multiples of 1/64 in [-1, 1]
// (now and then a float16 subnormal), int8 an integer.
double storable(Rng& rng, KV kv) {
  if (kv == KV::i8) return rng.integer(-127, 127);
  if (kv == KV::same) return float(rng.uniform(-1, 1));
  if (kv == KV::f16 && rng.chance(0.02)) return rng.integer(-255, 255) * std::ldexp(1.0, -24);
  return rng.integer(-64, 64) / 64.0;
}

template <class T>
struct AttnData {
  Case c;
  int nkv;
  index_t q_rs, k_rs, v_rs, o_rs;
  std::vector<T> q;
  std::vector<double> kd, vd;  // logical K, V (after int8 scales): [nkv][Lk][E], [nkv][Lk][Ev]
  std::vector<T> kf, vf;       // storage, float
  std::vector<std::uint16_t> kh, vh;
  std::vector<std::int8_t> k8, v8;
  std::vector<float> ks, vs;  // int8 scales, addressed like the rows
  std::vector<index_t> qoff, koff, voff, ooff, moff, lseoff, woff, ksoff, vsoff, bt_off, kvl, ql;
  std::vector<std::int32_t> table;
  std::vector<unsigned char> mb;
  std::vector<T> ma, slopes, sinks;
  std::vector<double> ref_out, ref_lse, ref_w;
};

// Storage row of key j of kv head h: contiguous, or row j % bs of block table[h * nb + j / bs].
template <class T>
index_t kv_row(const AttnData<T>& d, int h, int j) {
  if (!d.c.block_size) return index_t(h) * d.c.Lk + j;
  const int bs = d.c.block_size, nb = (d.c.Lk + bs - 1) / bs;
  return index_t(d.table[h * nb + j / bs]) * bs + j % bs;
}

template <class T>
void make_case(AttnData<T>& d, Rng& rng) {
  const Case& c = d.c;
  d.nkv = c.bh / c.group;
  d.q_rs = c.E + c.pad, d.k_rs = c.E + c.pad, d.v_rs = c.Ev + c.pad, d.o_rs = c.Ev + c.pad;
  d.q.resize(std::size_t(c.bh) * c.Lq * d.q_rs);
  for (auto& x : d.q) x = T(rng.uniform(-1, 1));
  const int bs = c.block_size, nb = bs ? (c.Lk + bs - 1) / bs : 0;
  // paged: the kv heads' blocks shuffled through one pool (plus two spare blocks never listed)
  if (bs) {
    std::vector<std::int32_t> perm(std::size_t(d.nkv) * nb + 2);
    for (std::size_t i = 0; i < perm.size(); ++i) perm[i] = std::int32_t(i);
    std::shuffle(perm.begin(), perm.end(), rng.g);
    d.table.assign(perm.begin(), perm.begin() + std::ptrdiff_t(d.nkv) * nb);
  }
  const std::size_t nrows = bs ? (std::size_t(d.nkv) * nb + 2) * bs : std::size_t(d.nkv) * c.Lk;
  d.kd.assign(std::size_t(d.nkv) * c.Lk * c.E, 0);
  d.vd.assign(std::size_t(d.nkv) * c.Lk * c.Ev, 0);
  const bool half = c.kv == KV::f16 || c.kv == KV::bf16;
  // Storage filled with NaN first: a kernel that reads a row or column it should not sees it.
  if (c.kv == KV::same) {
    d.kf.assign(nrows * d.k_rs, std::numeric_limits<T>::quiet_NaN());
    d.vf.assign(nrows * d.v_rs, std::numeric_limits<T>::quiet_NaN());
  } else if (half) {
    d.kh.assign(nrows * d.k_rs, 0x7fc0);  // NaN as float16 and as bfloat16
    d.vh.assign(nrows * d.v_rs, 0x7fc0);
  } else {
    d.k8.assign(nrows * d.k_rs, 0);
    d.v8.assign(nrows * d.v_rs, 0);
    d.ks.assign(nrows, std::numeric_limits<float>::quiet_NaN());
    d.vs.assign(nrows, std::numeric_limits<float>::quiet_NaN());
  }
  for (int h = 0; h < d.nkv; ++h)
    for (int j = 0; j < c.Lk; ++j) {
      const index_t row = kv_row(d, h, j);
      const float ksc = float(rng.uniform(0.002, 0.01)), vsc = float(rng.uniform(0.002, 0.01));
      if (c.kv == KV::i8) d.ks[row] = ksc, d.vs[row] = vsc;
      for (int e = 0; e < c.E + c.Ev; ++e) {
        const bool key = e < c.E;
        const int x = key ? e : e - c.E;
        const double val = storable(rng, c.kv);
        const index_t at = row * (key ? d.k_rs : d.v_rs) + x;
        double logical = val;
        if (c.kv == KV::same) (key ? d.kf : d.vf)[at] = T(val);
        if (c.kv == KV::f16) (key ? d.kh : d.vh)[at] = f16_bits(val);
        if (c.kv == KV::bf16) (key ? d.kh : d.vh)[at] = bf16_bits(val);
        if (c.kv == KV::i8) {
          (key ? d.k8 : d.v8)[at] = std::int8_t(val);
          logical = val * double(key ? ksc : vsc);
        }
        if (key)
          d.kd[(std::size_t(h) * c.Lk + j) * c.E + x] = logical;
        else
          d.vd[(std::size_t(h) * c.Lk + j) * c.Ev + x] = logical;
      }
    }
  for (int i = 0; i < c.bh; ++i) {
    d.qoff.push_back(index_t(i) * c.Lq * d.q_rs);
    d.ooff.push_back(index_t(i) * c.Lq * d.o_rs);
    d.koff.push_back(bs ? 0 : index_t(i / c.group) * c.Lk * d.k_rs);
    d.voff.push_back(bs ? 0 : index_t(i / c.group) * c.Lk * d.v_rs);
    d.ksoff.push_back(bs ? 0 : index_t(i / c.group) * c.Lk);
    d.vsoff.push_back(bs ? 0 : index_t(i / c.group) * c.Lk);
    d.moff.push_back(index_t(i) * c.Lq * c.Lk);
    d.lseoff.push_back(index_t(i) * c.Lq);
    d.woff.push_back(index_t(i) * c.Lq * c.Lk);
    d.bt_off.push_back(index_t(i / c.group) * nb);
    d.slopes.push_back(T(rng.uniform(0.01, 0.5)));
    d.sinks.push_back(T(rng.uniform(-1, 3)));
  }
  // kv_lens per kv head (a group shares its keys); q_lens per problem
  for (int h = 0; h < d.nkv; ++h) {
    const index_t n = rng.chance(0.1) ? 0 : rng.integer(1, c.Lk);
    for (int g = 0; g < c.group; ++g) d.kvl.push_back(c.kv_lens ? n : c.Lk);
  }
  for (int i = 0; i < c.bh; ++i) d.ql.push_back(c.q_lens ? rng.integer(0, c.Lq) : c.Lq);
  d.mb.resize(std::size_t(c.bh) * c.Lq * c.Lk);
  d.ma.resize(d.mb.size());
  for (std::size_t i = 0; i < d.mb.size(); ++i) {
    d.mb[i] = rng.chance(0.85);
    d.ma[i] = rng.chance(0.05) ? -std::numeric_limits<T>::infinity() : T(rng.uniform(-2, 1));
  }
}

// The definition (docs/api.md), in double on the values the kernels see.
template <class T>
void reference(AttnData<T>& d) {
  const Case& c = d.c;
  d.ref_out.assign(std::size_t(c.bh) * c.Lq * d.o_rs, 1234.5);  // unwritten: stays the filler
  d.ref_lse.assign(std::size_t(c.bh) * c.Lq, 1234.5);
  d.ref_w.assign(std::size_t(c.bh) * c.Lq * c.Lk, 0.0);
  const double scale = double(T(c.scale)), cap = c.softcap;
  const index_t wr = c.causal ? std::min<index_t>(c.wr, 0) : c.wr;
  for (int i = 0; i < c.bh; ++i) {
    const int h = i / c.group;
    const index_t Lq = d.ql[i], Lk = d.kvl[i], off = c.bottom_right ? Lk - Lq : 0;
    for (index_t qi = 0; qi < Lq; ++qi) {
      const index_t lo = std::max<index_t>(0, qi + off - c.wl), hi = std::min<index_t>(Lk, qi + off + wr + 1);
      std::vector<double> s(Lk, -kInf);
      double mx = c.sinks ? double(d.sinks[i]) : -kInf;
      for (index_t j = 0; j < Lk; ++j) {
        if (j < lo || j >= hi) continue;
        const std::size_t mi = std::size_t(d.moff[i] + qi * c.Lk + j);
        if (c.mask == MaskKind::boolean && !d.mb[mi]) continue;
        double x = 0;
        for (int e = 0; e < c.E; ++e)
          x += double(d.q[d.qoff[i] + qi * d.q_rs + e]) * d.kd[(std::size_t(h) * c.Lk + j) * c.E + e];
        x *= scale;
        if (cap > 0) x = cap * std::tanh(x / cap);
        if (c.alibi) x -= double(d.slopes[i]) * double(std::llabs(qi + off - j));
        if (c.mask == MaskKind::additive) x += double(d.ma[mi]);
        s[j] = x;
        mx = std::max(mx, x);
      }
      double* o = &d.ref_out[d.ooff[i] + qi * d.o_rs];
      double* w = &d.ref_w[d.woff[i] + qi * c.Lk];
      for (int e = 0; e < c.Ev; ++e) o[e] = 0;
      if (mx == -kInf) {
        d.ref_lse[d.lseoff[i] + qi] = -kInf;
        continue;
      }
      double l = c.sinks ? std::exp(double(d.sinks[i]) - mx) : 0;
      for (index_t j = 0; j < Lk; ++j) l += std::exp(s[j] - mx);
      for (index_t j = 0; j < Lk; ++j) {
        const double p = std::exp(s[j] - mx) / l;
        w[j] = p;
        for (int e = 0; e < c.Ev; ++e) o[e] += p * d.vd[(std::size_t(h) * c.Lk + j) * c.Ev + e];
      }
      d.ref_lse[d.lseoff[i] + qi] = mx + std::log(l);
    }
  }
}

template <class T>
void run_attention(const KernelSet& ks, const AttnData<T>& d, std::vector<T>& out, std::vector<T>& lse,
                   std::vector<T>& w) {
  const Case& c = d.c;
  out.assign(std::size_t(c.bh) * c.Lq * d.o_rs, T(1234.5));
  lse.assign(std::size_t(c.bh) * c.Lq, T(1234.5));
  w.assign(std::size_t(c.bh) * c.Lq * c.Lk, T(0));
  const void *k = nullptr, *v = nullptr;
  if (c.kv == KV::same) k = d.kf.data(), v = d.vf.data();
  if (c.kv == KV::f16 || c.kv == KV::bf16) k = d.kh.data(), v = d.vh.data();
  if (c.kv == KV::i8) k = d.k8.data(), v = d.v8.data();
  const index_t bs = c.block_size;
  const bool i8 = c.kv == KV::i8;
  AttnArgs a{};
  a.bh = c.bh, a.Lq = c.Lq, a.Lk = c.Lk, a.E = c.E, a.Ev = c.Ev, a.group = c.group;
  a.q = d.q.data(), a.qoff = d.qoff.data(), a.q_rs = d.q_rs;
  a.k = k, a.koff = d.koff.data(), a.k_rs = d.k_rs;
  a.v = v, a.voff = d.voff.data(), a.v_rs = d.v_rs;
  a.out = out.data(), a.ooff = d.ooff.data(), a.o_rs = d.o_rs;
  a.mask_kind = c.mask;
  a.mask = c.mask == MaskKind::boolean    ? static_cast<const void*>(d.mb.data())
           : c.mask == MaskKind::additive ? static_cast<const void*>(d.ma.data())
                                          : nullptr;
  a.moff = c.mask == MaskKind::none ? nullptr : d.moff.data(), a.m_rs = c.Lk, a.m_cs = 1;
  a.lse = c.lse ? lse.data() : nullptr, a.lseoff = c.lse ? d.lseoff.data() : nullptr, a.lse_s = 1;
  a.weights = c.weights ? w.data() : nullptr, a.woff = c.weights ? d.woff.data() : nullptr, a.w_rs = c.Lk;
  a.scale = c.scale, a.causal = c.causal, a.bottom_right = c.bottom_right, a.softcap = c.softcap;
  a.alibi = c.alibi ? d.slopes.data() : nullptr, a.sinks = c.sinks ? d.sinks.data() : nullptr;
  a.win_left = c.wl, a.win_right = c.wr;
  a.kv_lens = c.kv_lens ? d.kvl.data() : nullptr, a.q_lens = c.q_lens ? d.ql.data() : nullptr;
  a.block_table = bs ? d.table.data() : nullptr, a.bt_off = bs ? d.bt_off.data() : nullptr, a.block_size = bs;
  a.k_ps = bs * d.k_rs, a.v_ps = bs * d.v_rs;
  a.k_scale = i8 ? d.ks.data() : nullptr, a.ksoff = i8 ? d.ksoff.data() : nullptr, a.ks_rs = 1, a.ks_ps = bs;
  a.v_scale = i8 ? d.vs.data() : nullptr, a.vsoff = i8 ? d.vsoff.data() : nullptr, a.vs_rs = 1, a.vs_ps = bs;
  a.nthreads = c.threads;
  if (c.kv == KV::same)
    ks.table->attention[sizeof(T) == 8](a);
  else
    ks.table->attention_lowp[int(c.kv) - 1](a);
}

template <class T>
void test_attention(const std::vector<KernelSet>& sets, Rng& rng, const Case& c) {
  AttnData<T> d;
  d.c = c;
  make_case(d, rng);
  reference(d);
  std::vector<T> out, lse, w;
  for (const KernelSet& ks : sets) {
    run_attention(ks, d, out, lse, w);
    auto tol = [](std::size_t, double g, double r) { return same(g, r, Tol<T>::atol, Tol<T>::rtol); };
    const std::string what = ks.name + " attention " + Tol<T>::name() + " " + describe(c);
    Diff dd = compare(
        out.size(), [&](std::size_t i) { return double(out[i]); }, [&](std::size_t i) { return d.ref_out[i]; }, tol);
    check(dd.ok, what + " out" + describe(dd));
    if (c.lse) {
      dd = compare(
          lse.size(), [&](std::size_t i) { return double(lse[i]); }, [&](std::size_t i) { return d.ref_lse[i]; },
          [](std::size_t, double g, double r) { return same(g, r, 10 * Tol<T>::atol, Tol<T>::rtol); });
      check(dd.ok, what + " lse" + describe(dd));
    }
    if (c.weights) {
      dd = compare(
          w.size(), [&](std::size_t i) { return double(w[i]); }, [&](std::size_t i) { return d.ref_w[i]; }, tol);
      check(dd.ok, what + " weights" + describe(dd));
    }
  }
}

// A random case around a base shape: the score variants, masks, alignments, storage and threads
// drawn independently.
Case random_variant(Rng& rng, Case c, bool f32) {
  c.causal = rng.chance(0.35);
  c.bottom_right = rng.chance(0.5);
  const int m = rng.integer(0, 5);
  c.mask = m == 0 ? MaskKind::boolean : m == 1 ? MaskKind::additive : MaskKind::none;
  c.scale = rng.chance(0.25) ? 2.5 : 1.0 / std::sqrt(double(c.E));  // 2.5: scores far apart (rescaling)
  c.softcap = rng.chance(0.25) ? rng.uniform(2, 20) : 0;
  c.alibi = rng.chance(0.25);
  c.sinks = rng.chance(0.25);
  if (rng.chance(0.2)) c.wl = rng.integer(0, c.Lk);
  if (rng.chance(0.2)) c.wr = rng.integer(0, c.Lk);
  c.kv_lens = rng.chance(0.25);
  c.lse = rng.chance(0.5);
  c.weights = rng.chance(0.15);
  c.q_lens = rng.chance(0.1);
  c.block_size = rng.chance(0.25) ? (rng.chance(0.5) ? 16 : rng.integer(1, 7)) : 0;
  if (f32 && rng.chance(0.4)) c.kv = KV(rng.integer(1, 3));
  c.pad = rng.chance(0.3) ? rng.integer(1, 5) : 0;
  c.threads = rng.chance(0.3) ? 2 : 1;
  return c;
}

template <class T>
void attention_suite(const std::vector<KernelSet>& sets, Rng& rng, bool quick) {
  const bool f32 = sizeof(T) == 4;
  // Shapes: tile edges of every set (MR 4/6/8, NR 12/16/48, BK 128/256), odd sizes, GQA groups.
  struct Shape {
    int bh, group, Lq, Lk, E, Ev;
  };
  const Shape prefill[] = {
      {1, 1, 1, 1, 1, 1},     {1, 1, 3, 5, 3, 2},     {2, 1, 12, 12, 8, 8},   {1, 1, 13, 9, 4, 12},
      {2, 2, 17, 33, 16, 5},  {1, 1, 47, 129, 13, 7}, {3, 1, 49, 64, 64, 64}, {2, 1, 100, 300, 32, 24},
      {4, 2, 24, 257, 8, 16}, {1, 1, 97, 97, 12, 9},  {2, 1, 7, 400, 5, 33},  {1, 1, 130, 20, 24, 48},
  };
  // Decode (Lq * group <= 16, Lq <= 8): long keys split into chunks merged by their LSE.
  const Shape decode[] = {
      {1, 1, 1, 1, 8, 8},     {1, 1, 1, 70, 64, 64}, {4, 4, 1, 300, 13, 7}, {8, 2, 2, 1000, 32, 32},
      {2, 1, 8, 129, 16, 17}, {4, 4, 4, 600, 5, 64}, {1, 1, 3, 2000, 4, 4}, {2, 2, 1, 65, 128, 96},
  };
  const int variants = quick ? 3 : 10;
  for (const Shape& s : prefill) {
    Case base;
    base.bh = s.bh, base.group = s.group, base.Lq = s.Lq, base.Lk = s.Lk, base.E = s.E, base.Ev = s.Ev;
    base.scale = 1.0 / std::sqrt(double(s.E));
    test_attention<T>(sets, rng, base);  // plain
    for (int v = 0; v < variants; ++v) test_attention<T>(sets, rng, random_variant(rng, base, f32));
  }
  for (const Shape& s : decode) {
    Case base;
    base.bh = s.bh, base.group = s.group, base.Lq = s.Lq, base.Lk = s.Lk, base.E = s.E, base.Ev = s.Ev;
    base.scale = 1.0 / std::sqrt(double(s.E));
    test_attention<T>(sets, rng, base);
    for (int v = 0; v < variants; ++v) {
      Case c = random_variant(rng, base, f32);
      c.weights = c.q_lens = false;  // keeps the decode path
      test_attention<T>(sets, rng, c);
    }
  }
  // Each variant alone on one shape with every storage, so a failure names its cause.
  Case one;
  one.bh = 2, one.group = 2, one.Lq = 21, one.Lk = 150, one.E = 20, one.Ev = 12, one.scale = 0.3;
  for (int kv = 0; kv <= (f32 ? 3 : 0); ++kv) {
    Case c = one;
    c.kv = KV(kv);
    for (int variant = 0; variant < 12; ++variant) {
      Case x = c;
      switch (variant) {
        case 0: x.causal = true; break;
        case 1: x.causal = x.bottom_right = true; break;
        case 2: x.mask = MaskKind::boolean; break;
        case 3: x.mask = MaskKind::additive; break;
        case 4: x.wl = 9, x.wr = 3; break;
        case 5: x.softcap = 5; break;
        case 6: x.alibi = true; break;
        case 7: x.sinks = x.lse = true; break;
        case 8: x.kv_lens = x.bottom_right = true; break;
        case 9: x.block_size = 16; break;
        case 10: x.weights = x.lse = true; break;
        default: x.Lq = 2, x.alibi = true, x.softcap = 3, x.sinks = x.lse = true; break;  // decode
      }
      test_attention<T>(sets, rng, x);
    }
  }
}

template <class T>
void gemm_softmax_suite(const std::vector<KernelSet>& sets, Rng& rng, bool quick) {
  const int shapes[][3] = {{1, 1, 1},    {3, 5, 7},     {4, 40, 300},  {8, 12, 4},     {9, 13, 17},
                           {6, 16, 33},  {33, 29, 65},  {64, 48, 300}, {130, 97, 40},  {250, 20, 10},
                           {17, 500, 9}, {2, 700, 600}, {48, 48, 48},  {121, 13, 257}, {16, 49, 513}};
  int i = 0;
  for (const auto& s : shapes) {
    const int tr = i++ % 4;
    test_gemm<T>(sets, rng, s[0], s[1], s[2], false, false, 1, 1, 1);
    if (!quick) test_gemm<T>(sets, rng, s[0], s[1], s[2], tr & 1, tr & 2, 1 + (i % 3 == 0), 1 + i % 3, 1 + i % 2);
  }
  test_gemm<T>(sets, rng, 96, 96, 96, true, true, 2, 3, 2);
  test_gemm<T>(sets, rng, 3, 300, 900, false, false, 1, 2, 2);  // gemv, chunked over k
  const int sm[][2] = {{1, 1}, {3, 4}, {5, 5}, {7, 17}, {2, 64}, {4, 1000}, {33, 3}};
  for (const auto& s : sm)
    for (int mk = 0; mk < 3; ++mk)
      for (int var = 0; var < (quick ? 1 : 2); ++var)
        test_softmax<T>(sets, rng, s[0], s[1], 1 + var, 1 + 2 * var, MaskKind(mk), var ? 0 : 1, 0.7, 1 + var);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, dispatch_only = false;
  const char* expect_default = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--dispatch-only"))
      dispatch_only = true;
    else if (!std::strcmp(argv[i], "--expect-default") && i + 1 < argc)
      expect_default = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--expect-default NAME [--dispatch-only]]\n", argv[0]);
      return 2;
    }
  }
  // The set dispatch picks by itself, before any test switches it.
  const std::string chosen = active_isa().name;
  std::printf("default kernel set: %s (%s)\n", chosen.c_str(), isa_reason().c_str());
  if (expect_default) {
    check(chosen == expect_default, "default kernel set is " + chosen + ", expected " + expect_default);
    check(isa_supported("generic") && !isa_supported("no-such-set"), "isa_supported");
  }
  if (dispatch_only) {
    std::printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
  }
  const std::vector<KernelSet> sets = kernel_sets();
  std::printf("kernel sets under test:");
  for (const KernelSet& ks : sets) std::printf(" %s", ks.name.c_str());
  std::printf("\n");
#if defined(__aarch64__)
  check(std::any_of(sets.begin(), sets.end(), [](const KernelSet& k) { return k.name == "neon"; }),
        "the neon set is available on AArch64");
#endif
  Rng rng(20261130);
  gemm_softmax_suite<float>(sets, rng, quick);
  gemm_softmax_suite<double>(sets, rng, quick);
  attention_suite<float>(sets, rng, quick);
  attention_suite<double>(sets, rng, quick);
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
