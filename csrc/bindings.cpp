// The only pybind11 code: unpacks already-validated NumPy arrays into the kernel structs,
// releases the GIL and calls the active ISA's entry point. No validation happens here; the
// Python layer (pyattn/_api.py) has normalised dtypes, shapes, strides and offsets.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "frame/api.h"

namespace py = pybind11;
using pyattn::index_t;

namespace {

// The GIL released for a kernel call and taken back after it. Not py::gil_scoped_release: a
// daemon thread still in a call when the interpreter finalizes is ended inside
// PyEval_RestoreThread by pthread_exit, whose unwinding through that guard's noexcept destructor
// called std::terminate (the process aborted at exit; pybind11 issue 2215). This destructor lets
// the thread's unwinding pass, as it passes through NumPy's C frames.
class NoGil {
 public:
  NoGil() : ts_(PyEval_SaveThread()) {}
  ~NoGil() noexcept(false) { PyEval_RestoreThread(ts_); }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  PyThreadState* ts_;
};

const void* cptr(const py::array& a) { return a.data(); }
void* mptr(py::array& a) { return a.mutable_data(); }
const void* opt_cptr(const py::object& o) { return o.is_none() ? nullptr : py::cast<py::array>(o).data(); }
void* opt_mptr(const py::object& o) {
  if (o.is_none()) return nullptr;
  auto arr = py::cast<py::array>(o);
  return arr.mutable_data();
}
const index_t* offs(const py::object& o) { return static_cast<const index_t*>(opt_cptr(o)); }
int dt(const py::array& a) { return a.itemsize() == 4 ? 0 : 1; }

// Debug and sanitizer builds (PYATTN_DEBUG_CHECKS) check every pointer, size and stride the
// Python layer passes against the arrays they point into, so that a wrong argument is an
// IndexError here rather than silent memory corruption in a kernel. Release builds trust the
// Python layer, which is the one place that validates.
#ifdef PYATTN_DEBUG_CHECKS
constexpr bool kDebugChecks = true;
#define PYATTN_DEBUG_CHECK(cond, what)                                            \
  do {                                                                            \
    if (!(cond)) throw std::out_of_range(std::string("pyattn._core: ") + (what)); \
  } while (0)

// Element offsets [lo, hi] (from data()) that the view `a` itself spans.
std::pair<index_t, index_t> view_span(const py::array& a) {
  index_t lo = 0, hi = 0;
  for (py::ssize_t d = 0; d < a.ndim(); ++d) {
    if (a.shape(d) == 0) return {0, -1};
    const index_t reach = (index_t(a.shape(d)) - 1) * (index_t(a.strides(d)) / index_t(a.itemsize()));
    (reach < 0 ? lo : hi) += reach;
  }
  return {lo, hi};
}

// Every one of `count` matrices (rows x cols at strides rs, cs, starting at off[i], or 0 when
// off is None) lies inside the view of `arr`; `off` has at least `count` entries. With `lens`
// (int64, checked by check_lengths), matrix i has only min(rows, lens[i]) rows: the kernels read
// no more (varlen's packed sequences, whose longest may come first, end where the array does).
void check_matrices(const char* name, const py::object& arr, const py::object& off, index_t count, index_t rows,
                    index_t rs, index_t cols, index_t cs, const py::object& lens = py::none()) {
  if (arr.is_none()) return;
  if (count == 0 || rows == 0 || cols == 0) return;
  const py::array a = py::cast<py::array>(arr);
  const auto span = view_span(a);
  const index_t* o = nullptr;
  if (!off.is_none()) {
    const py::array oa = py::cast<py::array>(off);
    PYATTN_DEBUG_CHECK(oa.itemsize() == sizeof(index_t) && oa.ndim() == 1 && oa.strides(0) == sizeof(index_t),
                       std::string(name) + ": offsets must be a contiguous int64 vector");
    PYATTN_DEBUG_CHECK(index_t(oa.shape(0)) >= count, std::string(name) + ": fewer offsets than matrices");
    o = static_cast<const index_t*>(oa.data());
  }
  const index_t* n = lens.is_none() ? nullptr : static_cast<const index_t*>(py::cast<py::array>(lens).data());
  const index_t c_lo = std::min<index_t>(0, (cols - 1) * cs), c_hi = std::max<index_t>(0, (cols - 1) * cs);
  for (index_t i = 0; i < count; ++i) {
    const index_t ri = n ? std::min<index_t>(rows, n[i]) : rows;
    if (ri == 0) continue;
    const index_t r_lo = std::min<index_t>(0, (ri - 1) * rs), r_hi = std::max<index_t>(0, (ri - 1) * rs);
    const index_t base = o ? o[i] : 0;
    PYATTN_DEBUG_CHECK(base + r_lo + c_lo >= span.first && base + r_hi + c_hi <= span.second,
                       std::string(name) + ": matrix " + std::to_string(i) + " reaches outside its array");
  }
}

// An optional per-problem length vector: int64, at least bh entries, each in [0, max].
void check_lengths(const char* name, const py::object& obj, index_t bh, index_t max) {
  if (obj.is_none()) return;
  const py::array a = py::cast<py::array>(obj);
  PYATTN_DEBUG_CHECK(a.itemsize() == 8 && a.ndim() == 1 && index_t(a.shape(0)) >= bh,
                     std::string(name) + ": an int64 vector of bh entries");
  for (index_t i = 0; i < bh; ++i) {
    const index_t n = static_cast<const index_t*>(a.data())[i];
    PYATTN_DEBUG_CHECK(n >= 0 && n <= max, std::string(name) + ": a length outside [0, " + std::to_string(max) + "]");
  }
}

void check_same_dtype(const py::array& ref, std::initializer_list<std::pair<const char*, const py::object*>> arrs) {
  for (const auto& na : arrs) {
    if (na.second->is_none()) continue;
    // the type number, not the dtype object: an unpickled array (a Dask worker's) has an equal
    // dtype that is another object
    PYATTN_DEBUG_CHECK(py::cast<py::array>(*na.second).dtype().num() == ref.dtype().num(),
                       std::string(na.first) + ": dtype differs from the output's");
  }
}
#else
constexpr bool kDebugChecks = false;
#endif

// ----------------------------------------------------------------------------- small calls
// scaled_dot_product_attention's everyday call, whole: NumPy float32 or float64 arrays of one
// dtype and one leading shape (grouped-query heads allowed), unit feature stride, no mask, a new
// output or an out it can write in place; the score variants in their plain forms (a window of
// ints or None, a float softcap, per-head slopes and sinks as 1-D float arrays, kv_lens as a 1-D
// int array over the batch of a 4-D call). The general Python path spends ~14 us a call on
// broadcasting, strides and offsets, against a decode step's few microseconds of kernel, so this
// one is C, called through METH_FASTCALL (pybind11's argument dispatch alone costs ~1 us).
// It declines (returns None) anything else, and the Python layer, which is the definition of the
// contract and of every error message, takes over; so it never raises but MemoryError. It passes
// the kernel exactly the arguments the Python path would: results are bitwise the same.
namespace small {

struct View {
  char* data;
  int nd, typenum;
  Py_ssize_t itemsize;
  const Py_ssize_t *shape, *strides;
  int kv;  // K/V the float32 kernels read (attention_lowp[kv - 1]): 1 float16, 2 bfloat16, 3 int8
};

constexpr int kInt8 = 1, kFloat16 = 23, kFloat32 = 11, kFloat64 = 12;  // NPY_BYTE, NPY_HALF, NPY_FLOAT, NPY_DOUBLE
constexpr int kMaxDims = 64;                                           // NumPy 2's NPY_MAXDIMS (32 before)

// The kind of a half-precision element type the float32 kernels read as they are: 1 float16,
// 2 bfloat16 (ml_dtypes: a user type, known by its name once and then by its scalar type), 0
// anything else.
int half_kind(PyObject* descr) {
  static PyObject* bf16_type = nullptr;  // ml_dtypes.bfloat16, once seen
  const auto* d = py::detail::array_descriptor_proxy(descr);
  if (d->type_num == kFloat16) return 1;
  if (d->kind != 'V') return 0;
  if (bf16_type) return d->typeobj == bf16_type ? 2 : 0;
  PyObject* name = PyObject_GetAttrString(descr, "name");
  const bool is_bf16 = name && PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "bfloat16") == 0;
  Py_XDECREF(name);
  PyErr_Clear();
  if (!is_bf16) return 0;
  bf16_type = d->typeobj;
  Py_INCREF(bf16_type);  // kept for the life of the process, as ml_dtypes keeps its type
  return 2;
}

// A plain ndarray of native float32/float64 (or, with `half`, float16/bfloat16, and with `int8`,
// int8: v.kv says which), aligned, strides in whole elements, unit feature stride, at least
// `min_nd` axes, nothing empty.
bool view_of(PyObject* o, int min_nd, View& v, bool half = false, bool int8 = false) {
  const auto& api = py::detail::npy_api::get();
  if (Py_TYPE(o) != api.PyArray_Type_) return false;
  const auto* p = py::detail::array_proxy(o);
  const auto* d = py::detail::array_descriptor_proxy(p->descr);
  const int hk = int8 && d->type_num == kInt8 ? 3 : half && d->byteorder != '>' ? half_kind(p->descr) : 0;
  if (hk == 0 && ((d->type_num != kFloat32 && d->type_num != kFloat64) || d->byteorder != '=')) return false;
  const Py_ssize_t size = hk == 3 ? 1 : hk ? 2 : d->type_num == kFloat32 ? 4 : 8;
  v = View{p->data, p->nd, d->type_num, size, p->dimensions, p->strides, hk};
  if (v.nd < min_nd || reinterpret_cast<std::uintptr_t>(v.data) % v.itemsize) return false;
  for (int i = 0; i < v.nd; ++i)
    if (v.shape[i] == 0 || v.strides[i] % v.itemsize) return false;
  return v.shape[v.nd - 1] == 1 || v.strides[v.nd - 1] == v.itemsize;
}

index_t elems(const View& v, int axis) { return index_t(v.strides[axis] / v.itemsize); }

// Whether v may reach one element through two indices (_validate.may_self_overlap): false when
// its axes, taken by stride, each step past everything the smaller ones span. Such an out is
// written through a temporary by the Python path (threads would race on it, or a row read what
// another wrote).
bool may_self_overlap(const View& v) {
  Py_ssize_t s[kMaxDims], n[kMaxDims];
  int m = 0;
  for (int i = 0; i < v.nd; ++i)
    if (v.shape[i] > 1) {
      s[m] = v.strides[i] < 0 ? -v.strides[i] : v.strides[i];
      n[m++] = v.shape[i];
    }
  for (int i = 1; i < m; ++i)
    for (int j = i; j > 0 && s[j] < s[j - 1]; --j) {
      std::swap(s[j], s[j - 1]);
      std::swap(n[j], n[j - 1]);
    }
  Py_ssize_t span = v.itemsize;
  for (int i = 0; i < m; ++i) {
    if (s[i] < span) return true;
    span += s[i] * (n[i] - 1);
  }
  return false;
}

// Element offsets of every matrix of `a` over its first `nlead` axes, in C order, each repeated
// `repeat` times along the last of them (grouped-query heads): _validate.lead_offsets. Walks the
// index like an odometer into `off` (reused between calls: nothing allocated once it is large
// enough).
void lead_offsets(const View& a, int nlead, index_t repeat, std::vector<index_t>& off) {
  std::size_t n = 1;
  for (int ax = 0; ax < nlead; ++ax) n *= std::size_t(a.shape[ax]);
  const index_t rep = nlead ? repeat : 1;
  off.resize(n * std::size_t(rep));
  index_t idx[kMaxDims] = {}, o = 0;
  std::size_t w = 0;
  for (std::size_t i = 0; i < n; ++i) {
    for (index_t r = 0; r < rep; ++r) off[w++] = o;
    for (int ax = nlead - 1; ax >= 0; --ax) {
      o += elems(a, ax);
      if (++idx[ax] < a.shape[ax]) break;
      o -= elems(a, ax) * index_t(a.shape[ax]);
      idx[ax] = 0;
    }
  }
}

int flag(PyObject* o) { return o == Py_True ? 1 : o == Py_False ? 0 : -1; }

// A new C-contiguous array (uninitialised); throws the Python error when NumPy cannot make it.
py::object new_array(int typenum, int nd, const Py_ssize_t* dims) {
  const auto& api = py::detail::npy_api::get();
  auto a = py::reinterpret_steal<py::object>(
      api.PyArray_NewFromDescr_(api.PyArray_Type_, api.PyArray_DescrFromType_(typenum), nd,
                                const_cast<Py_ssize_t*>(dims), nullptr, nullptr, 0, nullptr));
  if (!a) throw py::error_already_set();
  return a;
}
void* data_of(const py::object& a) { return py::detail::array_proxy(a.ptr())->data; }

// Runs the float32 or float64 attention kernel (float32 on float16 / bfloat16 / int8 K/V when `kv`
// is 1 / 2 / 3) on `a` without the GIL (unless `run` is false: no key to read) and returns out, or
// (out, lse).
PyObject* attend(const pyattn::AttnArgs& a, int typenum, py::object& out, const py::object& lse, bool want_lse,
                 bool run = true, int kv = 0) {
  if (run) {
    const pyattn::IsaTable& isa = pyattn::active_isa();
    NoGil nogil;
    (kv ? isa.attention_lowp[kv - 1] : isa.attention[typenum == kFloat32 ? 0 : 1])(a);
  }
  if (!want_lse) return out.release().ptr();
  return PyTuple_Pack(2, out.ptr(), lse.ptr());
}

// f(), with whatever it throws turned into the Python error (nothing may escape into the C API).
template <class F>
PyObject* guarded(F&& f) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// A window side: None (no bound) or a non-negative int, capped at kNoLimit (_validate.window_sides).
bool window_side(PyObject* o, index_t& side) {
  if (o == Py_None) {
    side = pyattn::kNoLimit;
    return true;
  }
  if (!PyLong_CheckExact(o)) return false;  // bool and NumPy integers: the Python path
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow < 0 || (overflow == 0 && x < 0)) return false;
  side = overflow > 0 || x > pyattn::kNoLimit ? pyattn::kNoLimit : index_t(x);
  return true;
}
bool window_sides(PyObject* o, index_t& left, index_t& right) {
  left = right = pyattn::kNoLimit;
  if (o == Py_None) return true;
  if (!PyTuple_CheckExact(o) || PyTuple_GET_SIZE(o) != 2) return false;
  return window_side(PyTuple_GET_ITEM(o, 0), left) && window_side(PyTuple_GET_ITEM(o, 1), right);
}

constexpr double kLog2e = 1.4426950408889634074;  // the kernels' log2 units (frame/common.h)

// Whether the kernels' factors fit the computation's type: scale * log2(e) over the cap in log2
// units, and the cap in log2 units (_validate.kernel_factors). The everyday call (no cap, a
// scale far inside the type) costs two comparisons.
bool factors_fit(double scale, double cap, bool f32) {
  const double hi = f32 ? double(std::numeric_limits<float>::max()) : std::numeric_limits<double>::max();
  if (cap == 0.0 && std::fabs(scale) <= 1e30) return true;
  const double lo = f32 ? double(std::numeric_limits<float>::min()) : std::numeric_limits<double>::min();
  if (cap * kLog2e > hi || (cap > 0.0 && cap * kLog2e < lo)) return false;  // as Python: not cap > hi / log2(e)
  return !std::isfinite(scale) || std::fabs(scale * kLog2e / (cap > 0.0 ? cap * kLog2e : 1.0)) <= hi;
}

// A Python float or a numpy.float64 as such: another float subclass may define __float__, which
// the Python path's float() calls and PyFloat_AS_DOUBLE does not, so it takes that path.
bool plain_float(PyObject* o) {
  static PyTypeObject* const f64 =
      reinterpret_cast<PyTypeObject*>(py::object(py::module_::import("numpy").attr("float64")).release().ptr());
  return Py_TYPE(o) == &PyFloat_Type || Py_TYPE(o) == f64;
}

// softcap: None (0) or a finite float or int > 0 (_validate.softcap_value).
bool softcap_of(PyObject* o, double& cap) {
  cap = 0.0;
  if (o == Py_None) return true;
  if (plain_float(o))
    cap = PyFloat_AS_DOUBLE(o);
  else if (PyLong_CheckExact(o))
    cap = PyLong_AsDouble(o);
  else
    return false;
  if (cap == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return cap > 0.0 && cap < HUGE_VAL;
}

// A NumPy array of one axis of n elements, native byte order, of one of the kinds given ('f',
// 'i', 'u'); its type number and element size.
const py::detail::PyArray_Proxy* vector_of(PyObject* o, index_t n, const char* kinds, int& typenum, int& itemsize) {
  const auto& api = py::detail::npy_api::get();
  if (Py_TYPE(o) != api.PyArray_Type_) return nullptr;
  const auto* p = py::detail::array_proxy(o);
  const auto* d = py::detail::array_descriptor_proxy(p->descr);
  if (p->nd != 1 || p->dimensions[0] != n || !std::strchr(kinds, d->kind) || d->byteorder != '=') return nullptr;
  typenum = d->type_num;
  itemsize = int(py::dtype(py::reinterpret_borrow<py::object>(p->descr)).itemsize());
  return p;
}

// The S at p (NumPy data need not be aligned for S).
template <class S>
S read_at(const char* p) {
  S x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// A per-head quantity (ALiBi slopes, sinks): None, or a 1-D float32/float64 array of Hq values,
// written out for every problem (problem i is head i % Hq) in the compute type T, as
// _validate.per_head (NumPy's cast rounds to nearest, as static_cast does). Slopes give span > 0,
// the query-key distance bound: a bias past the integers T holds exactly declines
// (_validate.alibi_span).
template <class T>
bool per_head(PyObject* o, index_t Hq, index_t bh, std::vector<T>& buf, const void*& ptr, double span = 0.0) {
  ptr = nullptr;
  if (o == Py_None) return true;
  int typenum = 0, itemsize = 0;
  const auto* p = vector_of(o, Hq, "f", typenum, itemsize);
  if (!p || (typenum != kFloat32 && typenum != kFloat64)) return false;
  buf.resize(std::size_t(bh));
  for (index_t i = 0; i < bh; ++i) {
    const char* e = p->data + (i % Hq) * p->strides[0];
    const double given = typenum == kFloat32 ? double(read_at<float>(e)) : read_at<double>(e);
    // a finite double past T's range: the cast below would be undefined (the general path decides)
    if (std::isfinite(given) && std::fabs(given) > double(std::numeric_limits<T>::max())) return false;
    const T x = T(given);
    // the kernels take it in T, in log2 units: a finite value that overflows there is refused (Python)
    if (std::isfinite(given) && !std::isfinite(x * T(kLog2e))) return false;
    constexpr double exact = double(std::uint64_t(1) << std::numeric_limits<T>::digits);
    if (std::isfinite(given) && std::fabs(double(x)) * span * kLog2e > exact) return false;  // (as cast, as Python)
    buf[std::size_t(i)] = x;
  }
  ptr = buf.data();
  return true;
}

// kv_lens: None, or a 1-D int array of B counts in [0, Lk] for a (B, H, L, E) query, repeated
// over the H heads of each batch entry (_validate.key_counts). Anything else, and a count out of
// range (an error the Python path raises), declines.
bool key_counts(PyObject* o, const View& q, index_t Lk, std::vector<index_t>& buf, const index_t*& ptr) {
  ptr = nullptr;
  if (o == Py_None) return true;
  if (q.nd != 4) return false;
  const index_t B = q.shape[0], H = q.shape[1];
  int typenum = 0, itemsize = 0;
  const auto* p = vector_of(o, B, "iu", typenum, itemsize);
  if (!p || (itemsize != 4 && itemsize != 8)) return false;
  const bool is_signed = py::detail::array_descriptor_proxy(p->descr)->kind == 'i';
  buf.resize(std::size_t(B * H));
  for (index_t b = 0; b < B; ++b) {
    const char* e = p->data + b * p->strides[0];
    // as int64 when signed (a negative count declines), else as uint64
    const bool neg = is_signed && (itemsize == 4 ? read_at<std::int32_t>(e) < 0 : read_at<std::int64_t>(e) < 0);
    const std::uint64_t u = itemsize == 4 ? std::uint64_t(read_at<std::uint32_t>(e)) : read_at<std::uint64_t>(e);
    if (neg || u > std::uint64_t(Lk)) return false;
    for (index_t h = 0; h < H; ++h) buf[std::size_t(b * H + h)] = index_t(u);
  }
  ptr = buf.data();
  return true;
}

// The memory [lo, hi) that a view spans (for overlap checks).
std::pair<const char*, const char*> extent(const View& v) {
  const char *lo = v.data, *hi = v.data;
  for (int i = 0; i < v.nd; ++i) (v.strides[i] < 0 ? lo : hi) += (v.shape[i] - 1) * v.strides[i];
  return {lo, hi + v.itemsize};
}
bool overlap(const View& a, const View& b) {
  const auto x = extent(a), y = extent(b);
  return x.first < y.second && y.first < x.second;
}
// Whether the n elements of `size` bytes, `stride` elements apart from p, touch what `a` spans.
bool overlap(const View& a, const void* p, index_t n, index_t stride, std::size_t size) {
  const char* lo = static_cast<const char*>(p);
  const char* hi = lo + std::size_t(size);
  (stride < 0 ? lo : hi) += (n - 1) * stride * index_t(size);
  const auto x = extent(a);
  return n > 0 && x.first < hi && lo < x.second;
}

// Whether NumPy lets the array o be written in place without a word: writeable, and not one of
// the views NumPy warns about on writing (np.broadcast_arrays' results), which the Python path's
// flags.writeable check reports.
bool writable(PyObject* o) {
  constexpr int kWarnOnWrite = int(1u << 31);  // NPY_ARRAY_WARN_ON_WRITE
  const int flags = py::detail::array_proxy(o)->flags;
  return (flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_) != 0 && (flags & kWarnOnWrite) == 0;
}

// sdpa_small(query, key, value, is_causal, causal_align, scale, enable_gqa, return_lse, window,
//            softcap, alibi_slopes, sinks, kv_lens, out)
PyObject* sdpa(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 14) {
    PyErr_SetString(PyExc_TypeError, "sdpa_small takes 14 positional arguments");
    return nullptr;
  }
  const int causal = flag(args[3]), gqa = flag(args[6]), want_lse = flag(args[7]);
  if (causal < 0 || gqa < 0 || want_lse < 0 || !PyUnicode_CheckExact(args[4])) Py_RETURN_NONE;
  const int bottom_right = PyUnicode_CompareWithASCIIString(args[4], "bottom_right") == 0 ? 1
                           : PyUnicode_CompareWithASCIIString(args[4], "top_left") == 0   ? 0
                                                                                          : -1;
  if (bottom_right < 0) Py_RETURN_NONE;
  View q, k, v;
  const int min_nd = gqa ? 3 : 2;
  if (!view_of(args[0], min_nd, q) || !view_of(args[1], min_nd, k, true) || !view_of(args[2], min_nd, v, true))
    Py_RETURN_NONE;
  // K and V of the query's type, or both float16 / both bfloat16 with a float32 query
  const bool same = k.kv ? v.kv == k.kv && q.typenum == kFloat32 : k.typenum == q.typenum && !v.kv;
  if (!same || v.typenum != k.typenum || k.nd != q.nd || v.nd != q.nd) Py_RETURN_NONE;
  const int nd = q.nd, nlead = nd - 2, nouter = gqa ? nd - 3 : nlead;
  for (int i = 0; i < nouter; ++i)
    if (k.shape[i] != q.shape[i] || v.shape[i] != q.shape[i]) Py_RETURN_NONE;
  index_t group = 1;
  if (gqa) {
    const index_t Hq = q.shape[nd - 3], Hkv = k.shape[nd - 3];
    if (v.shape[nd - 3] != Hkv || Hq % Hkv) Py_RETURN_NONE;
    group = Hq / Hkv;
  }
  const index_t Lq = q.shape[nd - 2], E = q.shape[nd - 1], Lk = k.shape[nd - 2], Ev = v.shape[nd - 1];
  if (k.shape[nd - 1] != E || v.shape[nd - 2] != Lk) Py_RETURN_NONE;
  // out: written in place when it is a writable view of the result's shape and type that the
  // kernel can address (view_of) and that shares no memory with q, k or v; the Python path
  // takes any other (it writes through a temporary, or says what is wrong)
  View o{};
  const bool given = args[13] != Py_None;
  if (given) {
    if (!view_of(args[13], min_nd, o) || o.typenum != q.typenum || o.nd != nd || !writable(args[13])) Py_RETURN_NONE;
    for (int i = 0; i < nd - 2; ++i)
      if (o.shape[i] != q.shape[i]) Py_RETURN_NONE;
    if (o.shape[nd - 2] != Lq || o.shape[nd - 1] != Ev || overlap(o, q) || overlap(o, k) || overlap(o, v))
      Py_RETURN_NONE;
    if (may_self_overlap(o)) Py_RETURN_NONE;  // elements written twice (by different threads): the Python path
  }
  double scale;
  if (args[5] == Py_None) {
    scale = 1.0 / std::sqrt(double(E));
  } else if (plain_float(args[5])) {  // numpy.float64 too
    scale = PyFloat_AS_DOUBLE(args[5]);
  } else if (PyLong_CheckExact(args[5])) {
    scale = PyLong_AsDouble(args[5]);
    if (scale == -1.0 && PyErr_Occurred()) {  // too large: Python's float() says so
      PyErr_Clear();
      Py_RETURN_NONE;
    }
  } else {
    Py_RETURN_NONE;
  }
  index_t win_left, win_right;
  double cap;
  if (!window_sides(args[8], win_left, win_right) || !softcap_of(args[9], cap)) Py_RETURN_NONE;
  // the cap and the query's scale factor in log2 units in the query's type: past what it holds,
  // the general path refuses them (_validate.kernel_factors)
  if (!factors_fit(scale, cap, q.typenum == kFloat32)) Py_RETURN_NONE;
  const void *slopes = nullptr, *sinks = nullptr;
  const index_t* kv_lens = nullptr;
  if (args[10] != Py_None || args[11] != Py_None || args[12] != Py_None) {
    // Per-problem variant vectors, reused from call to call like the offsets below (declared
    // here: each thread_local costs its guard check on every pass through its declaration).
    thread_local std::vector<float> slopes32, sinks32;
    thread_local std::vector<double> slopes64, sinks64;
    thread_local std::vector<index_t> lens;
    if (nlead == 0) Py_RETURN_NONE;  // per-head values need a heads axis
    const index_t Hq = q.shape[nlead - 1];
    const double span = double(Lq) + double(Lk);
    index_t bh = 1;
    for (int i = 0; i < nlead; ++i) bh *= index_t(q.shape[i]);
    const bool ok =
        q.typenum == kFloat32
            ? per_head(args[10], Hq, bh, slopes32, slopes, span) && per_head(args[11], Hq, bh, sinks32, sinks)
            : per_head(args[10], Hq, bh, slopes64, slopes, span) && per_head(args[11], Hq, bh, sinks64, sinks);
    if (!ok || !key_counts(args[12], q, Lk, lens, kv_lens)) Py_RETURN_NONE;
  }

  return guarded([&]() -> PyObject* {
    Py_ssize_t dims[kMaxDims];
    for (int i = 0; i < nlead; ++i) dims[i] = q.shape[i];
    dims[nlead] = Lq;
    dims[nlead + 1] = Ev;
    py::object out = given ? py::reinterpret_borrow<py::object>(args[13]) : new_array(q.typenum, nd, dims);
    py::object lse = py::none();
    if (want_lse) {
      lse = new_array(q.typenum, nd - 1, dims);
    }
    // Reused from call to call (per calling thread): a decode loop allocates nothing here.
    thread_local std::vector<index_t> qoff, koff, voff, ooff, lseoff;
    lead_offsets(q, nlead, 1, qoff);
    lead_offsets(k, nlead, group, koff);
    lead_offsets(v, nlead, group, voff);
    const index_t bh = index_t(qoff.size());
    if (given) {
      lead_offsets(o, nlead, 1, ooff);
    } else {  // C-contiguous (a view_of it and lead_offsets cost 8% of the smallest call's core)
      ooff.resize(std::size_t(bh));
      for (index_t i = 0; i < bh; ++i) ooff[std::size_t(i)] = i * Lq * Ev;
    }
    if (want_lse) {
      lseoff.resize(std::size_t(bh));
      for (index_t i = 0; i < bh; ++i) lseoff[std::size_t(i)] = i * Lq;
    }
    void* out_data = data_of(out);
    void* lse_data = want_lse ? data_of(lse) : nullptr;
    // clang-format off: one line per pointer and its strides, as in api.h
    pyattn::AttnArgs a{bh, Lq, Lk, E, Ev, group,
                       q.data, qoff.data(), elems(q, nd - 2), k.data, koff.data(), elems(k, nd - 2),
                       v.data, voff.data(), elems(v, nd - 2),
                       out_data, ooff.data(), given ? elems(o, nd - 2) : Ev,
                       pyattn::MaskKind::none, nullptr, nullptr, 0, 0,
                       lse_data, want_lse ? lseoff.data() : nullptr, 1,
                       nullptr, nullptr, Lk,
                       scale, causal == 1, bottom_right == 1,
                       cap, slopes, sinks, win_left, win_right, kv_lens,
                       nullptr,
                       nullptr, nullptr, 0, 0, 0,
                       nullptr, nullptr, 0, 0,
                       nullptr, nullptr, 0, 0,
                       pyattn::get_num_threads()};
    // clang-format on
    return attend(a, q.typenum, out, lse, want_lse, true, k.kv);
  });
}

// A 1-D int64 vector of n entries, or a 2-D C-contiguous int32 table of n rows.
bool int64_vector(PyObject* o, index_t n, const std::int64_t*& data, index_t& stride) {
  int typenum = 0, itemsize = 0;
  const auto* p = vector_of(o, n, "i", typenum, itemsize);
  if (!p || itemsize != 8 || reinterpret_cast<std::uintptr_t>(p->data) % 8 || p->strides[0] % 8) return false;
  data = reinterpret_cast<const std::int64_t*>(p->data);
  stride = p->strides[0] / 8;
  return true;
}
bool int32_table(PyObject* o, index_t rows, const std::int32_t*& data, index_t& cols) {
  const auto& api = py::detail::npy_api::get();
  if (Py_TYPE(o) != api.PyArray_Type_) return false;
  const auto* p = py::detail::array_proxy(o);
  const auto* d = py::detail::array_descriptor_proxy(p->descr);
  if (p->nd != 2 || p->dimensions[0] != rows || d->kind != 'i' || d->byteorder != '=') return false;
  if (py::dtype(py::reinterpret_borrow<py::object>(p->descr)).itemsize() != 4) return false;
  if (p->strides[1] != 4 || p->strides[0] != 4 * p->dimensions[1] || reinterpret_cast<std::uintptr_t>(p->data) % 4)
    return false;
  data = reinterpret_cast<const std::int32_t*>(p->data);
  cols = p->dimensions[1];
  return true;
}

// float32 to float16 bits, rounded to nearest even as NumPy casts, for finite |x| < 65504
// (storable declines the rest: NumPy's overflow warning and NaN payloads stay its own).
std::uint16_t f16_bits(float x) {
  std::uint32_t f;
  std::memcpy(&f, &x, 4);
  const std::uint32_t sign = (f >> 16) & 0x8000u, a = f & 0x7fffffffu;
  if (a >= 0x38800000u) {  // a normal half: move the exponent's bias from 127 to 15, round 13 bits off
    const std::uint32_t r = a - 0x38000000u;
    return std::uint16_t(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  if (a < 0x33000000u) return std::uint16_t(sign);  // under half the smallest subnormal, 2^-25
  // a subnormal half: units of 2^-24, the 24-bit significand shifted right by 126 - exponent
  const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const int shift = 126 - int(a >> 23);
  const std::uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
  return std::uint16_t(sign | (q + (rem > halfway || (rem == halfway && (q & 1u)) ? 1u : 0u)));
}
// float32 to bfloat16 bits, rounded to nearest even as ml_dtypes casts (not NaN: declined).
std::uint16_t bf16_bits(float x) {
  std::uint32_t f;
  std::memcpy(&f, &x, 4);
  return std::uint16_t((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}
//   dst[i] = src[i] as float16 (kv = 1) or bfloat16 (2) bits, i < n
void to_half(const float* src, index_t n, int kv, char* dst) {
  for (index_t i = 0; i < n; ++i) {
    const std::uint16_t h = kv == 1 ? f16_bits(src[i]) : bf16_bits(src[i]);
    std::memcpy(dst + 2 * i, &h, 2);
  }
}
//   dst[i] = rint(src[i] / scale) in [-127, 127], *scale_at = scale = max|src| / 127 (1 for an
//   all-zero row), in float32 as _kvcache._quantize computes it (finite values only)
void quantize_row(const float* src, index_t n, char* dst, char* scale_at) {
  float amax = 0.0f;
  for (index_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(src[i]));
  float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
  // 127 scale stays finite: amax near the float32 maximum divided by 127 may round up, and the
  // row read back as 127 scale then overflowed (the values clip to 127 either way)
  if (std::isinf(scale * 127.0f)) scale = std::nextafter(scale, 0.0f);
  for (index_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(src[i] / scale);  // to nearest even, as np.rint
    dst[i] = static_cast<char>(static_cast<std::int8_t>(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r));
  }
  std::memcpy(scale_at, &scale, sizeof scale);
}

// An int8 cache's scales: a native float32 ndarray of the cache's first three axes (any whole-
// element strides), as _cache_attention requires.
bool scales_of(PyObject* o, const View& cache, View& v) {
  const auto& api = py::detail::npy_api::get();
  if (Py_TYPE(o) != api.PyArray_Type_) return false;
  const auto* p = py::detail::array_proxy(o);
  const auto* d = py::detail::array_descriptor_proxy(p->descr);
  if (d->type_num != kFloat32 || d->byteorder != '=' || p->nd != 3) return false;
  v = View{p->data, p->nd, d->type_num, 4, p->dimensions, p->strides, 0};
  if (reinterpret_cast<std::uintptr_t>(v.data) % 4) return false;
  for (int i = 0; i < 3; ++i)
    if (v.shape[i] != cache.shape[i] || v.strides[i] % 4) return false;
  return true;
}

// Whether every value of the (B, H, L, n) float32 view `v` converts as f16_bits / bf16_bits
// (kv 1 / 2) or quantize_row (3) do. int8 also declines a row whose scale max|x| / 127 would
// be subnormal or zero (max|x| < 1.5e-36): NumPy's division by it warns or raises there.
bool storable(const View& v, index_t B, index_t H, index_t L, index_t n, int kv) {
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < L; ++j) {
        const float* r =
            reinterpret_cast<const float*>(v.data + b * v.strides[0] + h * v.strides[1] + j * v.strides[2]);
        float amax = 0.0f;
        for (index_t i = 0; i < n; ++i) {
          if (kv == 1 ? !(std::fabs(r[i]) < 65504.0f) : kv == 2 ? std::isnan(r[i]) : !std::isfinite(r[i])) return false;
          amax = std::fmax(amax, std::fabs(r[i]));
        }
        if (kv == 3 && amax > 0.0f && amax / 127.0f < std::numeric_limits<float>::min()) return false;
      }
  return true;
}

// kvcache_small(query, k_cache, v_cache, cache_lens, k_new, v_new, block_table, scale, is_causal,
// return_lse, k_scale, v_scale): kvcache_attention's everyday call (a float cache of the query's dtype, or a
// float16 / bfloat16 / int8 one with a float32 query, contiguous or paged, no variant, a new
// output; k_scale, v_scale: an int8 cache's scales, else None), appends and attends; None for
// anything else, before anything is written.
PyObject* kvcache(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 12) {
    PyErr_SetString(PyExc_TypeError, "kvcache_small takes 12 positional arguments");
    return nullptr;
  }
  const int causal = flag(args[8]), want_lse = flag(args[9]);
  if (causal < 0 || want_lse < 0) Py_RETURN_NONE;
  View q, kc, vc, kn{}, vn{};
  if (!view_of(args[0], 4, q) || !view_of(args[1], 4, kc, true, true) || !view_of(args[2], 4, vc, true, true))
    Py_RETURN_NONE;
  // a cache of the query's type, or a float16 / bfloat16 / int8 one with a float32 query
  const int kv = kc.kv;
  if (q.nd != 4 || kc.nd != 4 || vc.nd != 4 || vc.kv != kv || vc.typenum != kc.typenum ||
      (kv ? q.typenum != kFloat32 : kc.typenum != q.typenum))
    Py_RETURN_NONE;
  const bool append = args[4] != Py_None;
  if (append != (args[5] != Py_None)) Py_RETURN_NONE;
  const index_t B = q.shape[0], Hq = q.shape[1], Lq = q.shape[2], E = q.shape[3];
  const index_t Hkv = kc.shape[1], Ev = vc.shape[3];
  if (kc.shape[3] != E || vc.shape[0] != kc.shape[0] || vc.shape[1] != Hkv || vc.shape[2] != kc.shape[2] || Hq % Hkv)
    Py_RETURN_NONE;
  const index_t group = Hq / Hkv;
  const bool paged = args[6] != Py_None;
  const std::int32_t* table = nullptr;
  index_t tcols = 0;
  if (paged ? !int32_table(args[6], B, table, tcols) : kc.shape[0] != B) Py_RETURN_NONE;
  View ks{}, vs{};  // int8: float32 scales laid out like the cache without its feature axis
  if (kv == 3 ? !scales_of(args[10], kc, ks) || !scales_of(args[11], vc, vs)
              : args[10] != Py_None || args[11] != Py_None)
    Py_RETURN_NONE;
  const index_t bsize = kc.shape[2], capacity = paged ? tcols * bsize : bsize;
  const std::int64_t* lens_data;
  index_t lens_s;
  if (!int64_vector(args[3], B, lens_data, lens_s)) Py_RETURN_NONE;
  if (append) {
    if (!view_of(args[4], 4, kn) || !view_of(args[5], 4, vn) || kn.nd != 4 || vn.nd != 4) Py_RETURN_NONE;
    if (kn.typenum != q.typenum || vn.typenum != q.typenum) Py_RETURN_NONE;
    const Py_ssize_t want_k[4] = {Py_ssize_t(B), Py_ssize_t(Hkv), Py_ssize_t(Lq), Py_ssize_t(E)};
    const Py_ssize_t want_v[4] = {Py_ssize_t(B), Py_ssize_t(Hkv), Py_ssize_t(Lq), Py_ssize_t(Ev)};
    for (int i = 0; i < 4; ++i)
      if (kn.shape[i] != want_k[i] || vn.shape[i] != want_v[i]) Py_RETURN_NONE;
    if (kn.strides[3] != kn.itemsize || vn.strides[3] != vn.itemsize) Py_RETURN_NONE;
    if (!writable(args[1]) || !writable(args[2]) || (kv == 3 && !(writable(args[10]) && writable(args[11]))))
      Py_RETURN_NONE;
    if (kv && !(storable(kn, B, Hkv, Lq, E, kv) && storable(vn, B, Hkv, Lq, Ev, kv))) Py_RETURN_NONE;
    // What is written (the caches, an int8 cache's scales) overlaps nothing else written, nor
    // what is read while writing or after it: the new rows, the lengths, the table, the query
    // (a query viewing the slots written would be read as overwritten: the Python path reads a
    // copy taken first).
    const View* written[] = {&kc, &vc, &ks, &vs};
    for (int i = 0; i < 4; ++i) {
      const View& w = *written[i];
      if (!w.data) continue;                    // no scales
      if (may_self_overlap(w)) Py_RETURN_NONE;  // the Python path refuses it
      bool clash = overlap(kn, w) || overlap(vn, w) || overlap(q, w) || overlap(w, lens_data, B, lens_s, 8) ||
                   (paged && overlap(w, table, B * tcols, 1, 4));
      for (int j = 0; j < i; ++j) clash = clash || (written[j]->data && overlap(w, *written[j]));
      if (clash) Py_RETURN_NONE;
    }
  }
  // The lengths and the table entries in use are copied before they are checked: the GIL is
  // dropped in the kernel, and another thread changing the caller's arrays must not change what
  // was checked (a block index out of range, or a length past the capacity).
  thread_local std::vector<index_t> held;
  thread_local std::vector<std::int32_t> blocks;
  held.resize(std::size_t(B));
  if (paged) blocks.resize(std::size_t(B * tcols));
  index_t Lk = 0;
  for (index_t b = 0; b < B; ++b) {
    const index_t n = held[std::size_t(b)] = lens_data[b * lens_s];
    if (n < 0 || n > capacity - (append ? Lq : 0)) Py_RETURN_NONE;  // (n + Lq could overflow)
    const index_t keys = n + (append ? Lq : 0);
    Lk = keys > Lk ? keys : Lk;
    if (paged)
      for (index_t i = 0, need = (keys + bsize - 1) / bsize; i < need; ++i) {
        const std::int32_t blk = blocks[std::size_t(b * tcols + i)] = table[b * tcols + i];
        if (blk < 0 || blk >= kc.shape[0]) Py_RETURN_NONE;
      }
  }
  if (paged) table = blocks.data();
  double scale;
  if (args[7] == Py_None) {
    scale = 1.0 / std::sqrt(double(E));
  } else if (plain_float(args[7])) {
    scale = PyFloat_AS_DOUBLE(args[7]);
  } else {
    Py_RETURN_NONE;
  }
  if (!factors_fit(scale, 0.0, q.typenum == kFloat32)) Py_RETURN_NONE;  // (_validate.kernel_factors)

  return guarded([&]() -> PyObject* {
    // Every check is done, and the results are allocated (a MemoryError leaves the cache as it
    // was): only now is anything written.
    const Py_ssize_t dims[4] = {Py_ssize_t(B), Py_ssize_t(Hq), Py_ssize_t(Lq), Py_ssize_t(Ev)};
    py::object out = new_array(q.typenum, 4, dims);
    py::object lse = want_lse ? new_array(q.typenum, 3, dims) : py::none();
    if (append) {
      auto put = [&](const View& src, const View& dst, const View& sc, index_t n) {
        for (index_t b = 0; b < B; ++b)
          for (index_t h = 0; h < Hkv; ++h)
            for (index_t j = 0; j < Lq; ++j) {
              const index_t pos = held[std::size_t(b)] + j;
              const index_t blk = paged ? table[b * tcols + pos / bsize] : b, row = paged ? pos % bsize : pos;
              char* to = dst.data + blk * dst.strides[0] + h * dst.strides[1] + row * dst.strides[2];
              const char* from = src.data + b * src.strides[0] + h * src.strides[1] + j * src.strides[2];
              if (kv == 3)
                quantize_row(reinterpret_cast<const float*>(from), n, to,
                             sc.data + blk * sc.strides[0] + h * sc.strides[1] + row * sc.strides[2]);
              else if (kv)
                to_half(reinterpret_cast<const float*>(from), n, kv, to);
              else
                std::memcpy(to, from, std::size_t(n) * std::size_t(src.itemsize));
            }
      };
      put(kn, kc, ks, E);
      put(vn, vc, vs, Ev);
    }
    char* out_data = static_cast<char*>(data_of(out));
    std::memset(out_data, 0, std::size_t(B * Hq * Lq * Ev) * std::size_t(q.itemsize));
    if (want_lse) {
      char* l = static_cast<char*>(data_of(lse));
      for (index_t i = 0; i < B * Hq * Lq; ++i) {
        if (q.typenum == kFloat32)
          reinterpret_cast<float*>(l)[i] = -std::numeric_limits<float>::infinity();
        else
          reinterpret_cast<double*>(l)[i] = -std::numeric_limits<double>::infinity();
      }
    }
    thread_local std::vector<index_t> qoff, koff, voff, ooff, lseoff, kv_lens, bt_off, ksoff, vsoff;
    const std::size_t bh = std::size_t(B * Hq);
    for (auto* v : {&qoff, &koff, &voff, &ooff, &lseoff, &kv_lens, &bt_off, &ksoff, &vsoff}) v->resize(bh);
    for (index_t b = 0, i = 0; b < B; ++b)
      for (index_t h = 0; h < Hq; ++h, ++i) {
        qoff[i] = b * elems(q, 0) + h * elems(q, 1);
        koff[i] = (paged ? 0 : b * elems(kc, 0)) + (h / group) * elems(kc, 1);
        voff[i] = (paged ? 0 : b * elems(vc, 0)) + (h / group) * elems(vc, 1);
        ooff[i] = i * Lq * Ev;
        lseoff[i] = i * Lq;
        kv_lens[i] = held[std::size_t(b)] + (append ? Lq : 0);
        bt_off[i] = b * tcols;
        if (kv == 3) {
          ksoff[i] = (paged ? 0 : b * elems(ks, 0)) + (h / group) * elems(ks, 1);
          vsoff[i] = (paged ? 0 : b * elems(vs, 0)) + (h / group) * elems(vs, 1);
        }
      }
    const bool i8 = kv == 3;
    // clang-format off: one line per pointer and its strides, as in api.h
    pyattn::AttnArgs a{index_t(bh), Lq, Lk, E, Ev, group,
                       q.data, qoff.data(), elems(q, 2), kc.data, koff.data(), elems(kc, 2),
                       vc.data, voff.data(), elems(vc, 2),
                       out_data, ooff.data(), Ev,
                       pyattn::MaskKind::none, nullptr, nullptr, 0, 0,
                       want_lse ? data_of(lse) : nullptr,
                       want_lse ? lseoff.data() : nullptr, 1,
                       nullptr, nullptr, 0,
                       scale, causal == 1, true,
                       0.0, nullptr, nullptr, pyattn::kNoLimit, pyattn::kNoLimit, kv_lens.data(),
                       nullptr,
                       table, paged ? bt_off.data() : nullptr, paged ? bsize : 0,
                       elems(kc, 0), elems(vc, 0),  // k_ps, v_ps: between blocks (paged; unused otherwise)
                       i8 ? reinterpret_cast<const float*>(ks.data) : nullptr, i8 ? ksoff.data() : nullptr,
                       i8 ? elems(ks, 2) : 0, i8 ? elems(ks, 0) : 0,
                       i8 ? reinterpret_cast<const float*>(vs.data) : nullptr, i8 ? vsoff.data() : nullptr,
                       i8 ? elems(vs, 2) : 0, i8 ? elems(vs, 0) : 0,
                       pyattn::get_num_threads()};
    // clang-format on
    return attend(a, q.typenum, out, lse, want_lse, Lk > 0, kv);
  });
}

PyMethodDef kvcache_def = {
    "kvcache_small", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&kvcache)), METH_FASTCALL,
    "kvcache_small(query, k_cache, v_cache, cache_lens, k_new, v_new, block_table, scale, is_causal, return_lse, "
    "k_scale, v_scale) -> "
    "object\n\n"
    "kvcache_attention's common case in C (a float cache of the query's dtype, or a float16 / bfloat16 / int8 one with "
    "a "
    "float32 query, contiguous or paged, no variant, a new output): the output (and lse) after the append, or None, "
    "having written nothing, when the call is not that "
    "case."};

PyMethodDef sdpa_def = {
    "sdpa_small", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&sdpa)), METH_FASTCALL,
    "sdpa_small(query, key, value, is_causal, causal_align, scale, enable_gqa, return_lse, window, softcap, "
    "alibi_slopes, sinks, kv_lens, out) -> object\n\n"
    "scaled_dot_product_attention's common case in C (plain float arrays of one dtype, or float16 / bfloat16 key "
    "and value with a float32 query, one leading shape, no mask, "
    "the score variants in their plain forms, a new output or one written in place): the output (and lse), or "
    "None when the call is not that case."};

}  // namespace small

std::string compiler() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#else
  return "unknown";
#endif
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "pyattn compute kernels (private; use the pyattn package)";

  m.def(
      "gemm",
      [](const py::array& a, const py::array& b, py::array& c, index_t m_, index_t n, index_t k, index_t rsa,
         index_t csa, index_t rsb, index_t csb, index_t rsc, index_t csc, index_t batch, const py::object& offa,
         const py::object& offb, const py::object& offc) {
#ifdef PYATTN_DEBUG_CHECKS
        check_same_dtype(c, {{"a", &a}, {"b", &b}});
        check_matrices("a", a, offa, batch, m_, rsa, k, csa);
        check_matrices("b", b, offb, batch, k, rsb, n, csb);
        check_matrices("c", c, offc, batch, m_, rsc, n, csc);
#endif
        // clang-format off: one line per pointer and its strides, as in api.h
        pyattn::GemmArgs g{m_, n, k, cptr(a), rsa, csa, cptr(b), rsb, csb, mptr(c), rsc, csc,
                           batch, offs(offa), offs(offb), offs(offc), pyattn::get_num_threads()};
        // clang-format on
        NoGil nogil;
        pyattn::active_isa().gemm[dt(c)](g);
      },
      "c[i] = a[i] @ b[i] for each of `batch` matrices at the given element offsets and strides.", py::arg("a"),
      py::arg("b"), py::arg("c"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("rsa"), py::arg("csa"),
      py::arg("rsb"), py::arg("csb"), py::arg("rsc"), py::arg("csc"), py::arg("batch"), py::arg("offa"),
      py::arg("offb"), py::arg("offc"));

  m.def(
      "softmax",
      [](const py::array& x, py::array& out, index_t rows, index_t n, const py::object& xoff, index_t xcs,
         const py::object& ooff, index_t ocs, int mask_kind, const py::object& mask, const py::object& moff,
         index_t mcs, double scale) {
#ifdef PYATTN_DEBUG_CHECKS
        check_same_dtype(out, {{"x", &x}});
        PYATTN_DEBUG_CHECK(!xoff.is_none() && !ooff.is_none(), "softmax: row offsets are required");
        PYATTN_DEBUG_CHECK(mask_kind >= 0 && mask_kind <= 2 && (mask_kind == 0) == mask.is_none(),
                           "softmax: mask_kind does not match mask");
        if (mask_kind == 2) check_same_dtype(out, {{"mask", &mask}});
        if (mask_kind == 1) PYATTN_DEBUG_CHECK(py::cast<py::array>(mask).itemsize() == 1, "mask: bool masks are uint8");
        check_matrices("x", x, xoff, rows, 1, 0, n, xcs);
        check_matrices("out", out, ooff, rows, 1, 0, n, ocs);
        check_matrices("mask", mask, moff, rows, 1, 0, n, mcs);
#endif
        // clang-format off: one line per pointer and its strides, as in api.h
        pyattn::SoftmaxArgs s{rows, n, cptr(x), offs(xoff), xcs, mptr(out), offs(ooff), ocs,
                              pyattn::MaskKind(mask_kind), opt_cptr(mask), offs(moff), mcs, scale,
                              pyattn::get_num_threads()};
        // clang-format on
        NoGil nogil;
        pyattn::active_isa().softmax[dt(out)](s);
      },
      "out row r = softmax(x row r * scale + mask row r), rows at the given offsets.", py::arg("x"), py::arg("out"),
      py::arg("rows"), py::arg("n"), py::arg("xoff"), py::arg("xcs"), py::arg("ooff"), py::arg("ocs"),
      py::arg("mask_kind"), py::arg("mask").none(true), py::arg("moff").none(true), py::arg("mcs"), py::arg("scale"));

  m.def(
      "attention",
      [](const py::array& q, const py::array& k, const py::array& v, py::array& out, index_t bh, index_t Lq, index_t Lk,
         index_t E, index_t Ev, index_t group, const py::object& qoff, index_t q_rs, const py::object& koff,
         index_t k_rs, const py::object& voff, index_t v_rs, const py::object& ooff, index_t o_rs, int mask_kind,
         const py::object& mask, const py::object& moff, index_t m_rs, index_t m_cs, const py::object& lse,
         const py::object& lseoff, index_t lse_s, const py::object& weights, const py::object& woff, index_t w_rs,
         double scale, bool causal, bool bottom_right, double softcap, const py::object& alibi, const py::object& sinks,
         index_t win_left, index_t win_right, const py::object& kv_lens, int kv_type, const py::object& q_lens,
         const py::object& block_table, const py::object& bt_off, index_t block_size, index_t k_ps, index_t v_ps,
         const py::object& k_scale, const py::object& ksoff, index_t ks_rs, index_t ks_ps, const py::object& v_scale,
         const py::object& vsoff, index_t vs_rs, index_t vs_ps) {
#ifdef PYATTN_DEBUG_CHECKS
        check_same_dtype(out, {{"q", &q}, {"lse", &lse}, {"weights", &weights}, {"alibi", &alibi}, {"sinks", &sinks}});
        PYATTN_DEBUG_CHECK(kv_type >= 0 && kv_type <= 3, "attention: kv_type must be 0 to 3");
        if (kv_type == 0) check_same_dtype(out, {{"k", &k}, {"v", &v}});
        if (kv_type != 0)
          PYATTN_DEBUG_CHECK(
              out.itemsize() == 4 && k.itemsize() == (kv_type == 3 ? 1 : 2) && v.itemsize() == k.itemsize(),
              "attention: low-precision K/V need 2-byte (1-byte int8) k and v and a float32 output");
        PYATTN_DEBUG_CHECK((kv_type == 3) == !k_scale.is_none() && (kv_type == 3) == !v_scale.is_none(),
                           "attention: int8 K/V need their scales, and only they");
        check_lengths("q_lens", q_lens, bh, Lq);
        PYATTN_DEBUG_CHECK(softcap >= 0 && win_left >= 0 && win_right >= 0, "attention: negative softcap or window");
        check_matrices("alibi", alibi, py::none(), 1, 1, 0, bh, 1);
        check_matrices("sinks", sinks, py::none(), 1, 1, 0, bh, 1);
        check_lengths("kv_lens", kv_lens, bh, Lk);
        PYATTN_DEBUG_CHECK(!qoff.is_none() && !koff.is_none() && !voff.is_none() && !ooff.is_none(),
                           "attention: q, k, v and out offsets are required");
        PYATTN_DEBUG_CHECK(group >= 1 && bh % group == 0, "attention: bh must be a multiple of group");
        PYATTN_DEBUG_CHECK(mask_kind >= 0 && mask_kind <= 2 && (mask_kind == 0) == mask.is_none(),
                           "attention: mask_kind does not match mask");
        if (mask_kind == 2) check_same_dtype(out, {{"mask", &mask}});
        if (mask_kind == 1) PYATTN_DEBUG_CHECK(py::cast<py::array>(mask).itemsize() == 1, "mask: bool masks are uint8");
        check_matrices("q", q, qoff, bh, Lq, q_rs, E, 1, q_lens);
        if (block_table.is_none()) {
          check_matrices("k", k, koff, bh, Lk, k_rs, E, 1, kv_lens);
          check_matrices("v", v, voff, bh, Lk, v_rs, Ev, 1, kv_lens);
          check_matrices("k_scale", k_scale, ksoff, bh, Lk, ks_rs, 1, 1, kv_lens);
          check_matrices("v_scale", v_scale, vsoff, bh, Lk, vs_rs, 1, 1, kv_lens);
        } else {  // every block a problem may read exists (for its own kv_lens keys)
          const py::array bt = py::cast<py::array>(block_table), bo = py::cast<py::array>(bt_off);
          PYATTN_DEBUG_CHECK(bt.itemsize() == 4 && bo.itemsize() == 8 && block_size > 0,
                             "block_table: int32 blocks, int64 offsets");
          const index_t nblocks = index_t(k.shape(0));
          const index_t* kl =
              kv_lens.is_none() ? nullptr : static_cast<const index_t*>(py::cast<py::array>(kv_lens).data());
          for (index_t i = 0; i < bh; ++i)
            for (index_t b = 0, need = ((kl ? kl[i] : Lk) + block_size - 1) / block_size; b < need; ++b) {
              const index_t at = static_cast<const index_t*>(bo.data())[i] + b;
              PYATTN_DEBUG_CHECK(at >= 0 && at < index_t(bt.size()), "block_table: too few entries");
              const index_t blk = static_cast<const std::int32_t*>(bt.data())[at];
              PYATTN_DEBUG_CHECK(blk >= 0 && blk < nblocks, "block_table: a block outside the cache");
            }
        }
        check_matrices("out", out, ooff, bh, Lq, o_rs, Ev, 1, q_lens);
        check_matrices("mask", mask, moff, bh, Lq, m_rs, Lk, m_cs, q_lens);
        check_matrices("lse", lse, lseoff, bh, Lq, lse_s, 1, 1, q_lens);
        check_matrices("weights", weights, woff, bh, Lq, w_rs, Lk, 1, q_lens);
#endif
        // clang-format off: one line per pointer and its strides, as in api.h
        pyattn::AttnArgs a{bh, Lq, Lk, E, Ev, group,
                           cptr(q), offs(qoff), q_rs, cptr(k), offs(koff), k_rs, cptr(v), offs(voff), v_rs,
                           mptr(out), offs(ooff), o_rs,
                           pyattn::MaskKind(mask_kind), opt_cptr(mask), offs(moff), m_rs, m_cs,
                           opt_mptr(lse), offs(lseoff), lse_s,
                           opt_mptr(weights), offs(woff), w_rs,
                           scale, causal, bottom_right,
                           softcap, opt_cptr(alibi), opt_cptr(sinks), win_left, win_right, offs(kv_lens),
                           offs(q_lens),
                           static_cast<const std::int32_t*>(opt_cptr(block_table)), offs(bt_off), block_size, k_ps, v_ps,
                           static_cast<const float*>(opt_cptr(k_scale)), offs(ksoff), ks_rs, ks_ps,
                           static_cast<const float*>(opt_cptr(v_scale)), offs(vsoff), vs_rs, vs_ps,
                           pyattn::get_num_threads()};
        // clang-format on
        NoGil nogil;
        const pyattn::IsaTable& isa = pyattn::active_isa();
        (kv_type == 0 ? isa.attention[dt(out)] : isa.attention_lowp[kv_type - 1])(a);
      },
      "Fused attention over bh (batch, head) problems at the given element offsets and strides.", py::arg("q"),
      py::arg("k"), py::arg("v"), py::arg("out"), py::arg("bh"), py::arg("Lq"), py::arg("Lk"), py::arg("E"),
      py::arg("Ev"), py::arg("group"), py::arg("qoff"), py::arg("q_rs"), py::arg("koff"), py::arg("k_rs"),
      py::arg("voff"), py::arg("v_rs"), py::arg("ooff"), py::arg("o_rs"), py::arg("mask_kind"),
      py::arg("mask").none(true), py::arg("moff").none(true), py::arg("m_rs"), py::arg("m_cs"),
      py::arg("lse").none(true), py::arg("lseoff").none(true), py::arg("lse_s"), py::arg("weights").none(true),
      py::arg("woff").none(true), py::arg("w_rs"), py::arg("scale"), py::arg("causal"), py::arg("bottom_right"),
      py::arg("softcap"), py::arg("alibi").none(true), py::arg("sinks").none(true), py::arg("win_left"),
      py::arg("win_right"), py::arg("kv_lens").none(true), py::arg("kv_type"), py::arg("q_lens").none(true),
      py::arg("block_table").none(true), py::arg("bt_off").none(true), py::arg("block_size"), py::arg("k_ps"),
      py::arg("v_ps"), py::arg("k_scale").none(true), py::arg("ksoff").none(true), py::arg("ks_rs"), py::arg("ks_ps"),
      py::arg("v_scale").none(true), py::arg("vsoff").none(true), py::arg("vs_rs"), py::arg("vs_ps"));

  m.def(
      "merge",
      [](const py::list& outs, const std::vector<index_t>& o_rs, const py::list& lses, const std::vector<index_t>& l_s,
         py::array& out, index_t out_rs, py::array& out_lse, index_t rows, index_t Ev) {
        const std::size_t n = outs.size();
#ifdef PYATTN_DEBUG_CHECKS
        PYATTN_DEBUG_CHECK(lses.size() == n && o_rs.size() == n && l_s.size() == n, "merge: one stride per state");
#endif
        std::vector<py::array> o(n), l(n);  // held here: the pointers below stay valid
        std::vector<const void*> op(n);
        std::vector<const double*> lp(n);
        for (std::size_t i = 0; i < n; ++i) {
          o[i] = py::cast<py::array>(outs[i]);
          l[i] = py::cast<py::array>(lses[i]);
          op[i] = cptr(o[i]);
          lp[i] = static_cast<const double*>(cptr(l[i]));
        }
#ifdef PYATTN_DEBUG_CHECKS
        PYATTN_DEBUG_CHECK(out_lse.itemsize() == 8, "merge: the lse is float64");
        check_matrices("out", out, py::none(), 1, rows, out_rs, Ev, 1);
        check_matrices("out_lse", out_lse, py::none(), 1, 1, 0, rows, 1);
        for (std::size_t i = 0; i < n; ++i) {
          check_same_dtype(out, {{"outs[i]", &o[i]}});
          PYATTN_DEBUG_CHECK(l[i].itemsize() == 8, "merge: lses are float64");
          check_matrices("outs[i]", o[i], py::none(), 1, rows, o_rs[i], Ev, 1);
          check_matrices("lses[i]", l[i], py::none(), 1, 1, 0, rows, l_s[i]);
        }
#endif
        // clang-format off: one line per pointer and its strides, as in api.h
        pyattn::MergeArgs g{index_t(n), rows, Ev,
                            op.data(), o_rs.data(),
                            lp.data(), l_s.data(),
                            mptr(out), out_rs,
                            static_cast<double*>(mptr(out_lse)),
                            pyattn::get_num_threads()};
        // clang-format on
        NoGil nogil;
        pyattn::active_isa().merge[dt(out)](g);
      },
      "Merge n attention states (rows x Ev outputs, float64 lses) into out and out_lse.", py::arg("outs"),
      py::arg("o_rs"), py::arg("lses"), py::arg("l_s"), py::arg("out"), py::arg("out_rs"), py::arg("out_lse"),
      py::arg("rows"), py::arg("Ev"));

  m.add_object("kvcache_small",
               py::reinterpret_steal<py::object>(PyCFunction_NewEx(&small::kvcache_def, nullptr, nullptr)));
  m.add_object("sdpa_small", py::reinterpret_steal<py::object>(PyCFunction_NewEx(&small::sdpa_def, nullptr, nullptr)));
  m.def("isa", [] { return std::string(pyattn::active_isa().name); }, "Name of the kernel set in use.");
  m.def("isa_reason", &pyattn::isa_reason, "Why the kernel set in use was chosen (CPU flags, PYATTN_ISA, set_isa).");
  m.def("decode_prefetch_streams", &pyattn::decode_prefetch_streams,
        "Whether the decode prefetches single streamed K/V rows key by key (CPU vendor, PYATTN_DECODE_PREFETCH).");
  m.def(
      "set_isa", [](const std::string& name) { return pyattn::set_active_isa(name.c_str()); }, py::arg("name"),
      "Switch kernel set (tests); returns False if this CPU cannot run it.");
  m.def("available_isas", [] {
    std::vector<std::string> out;
    for (const char* n : {"generic", "avx2", "avx512", "neon"})
      if (pyattn::isa_supported(n)) out.emplace_back(n);
    return out;
  });
  m.def("get_num_threads", &pyattn::get_num_threads);
  m.def("set_num_threads", &pyattn::set_num_threads, py::arg("n"));
  m.def("thread_setting", &pyattn::thread_setting, "The count set_num_threads stored, 0 when unset (OpenMP's).");
  m.def("default_num_threads", &pyattn::default_num_threads);
  m.def("forked_after_team", &pyattn::forked_after_team,
        "Whether this process was forked after its parent ran a multi-threaded call (it runs on one thread).");
  m.attr("debug_checks") = kDebugChecks;
  m.attr("compiler") = compiler();
#ifdef PYATTN_VERSION
  m.attr("__version__") = PYATTN_VERSION;
#endif
}
