// The only pybind11 code: unpacks already-validated NumPy arrays into the kernel structs,
// releases the GIL and calls the active ISA's entry point. No validation happens here; the
// Python layer (pyattn/_api.py) has normalised dtypes, shapes, strides and offsets.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "frame/api.h"

namespace py = pybind11;
using pyattn::index_t;

namespace {

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

  m.def("gemm", [](const py::array& a, const py::array& b, py::array& c, index_t m_, index_t n, index_t k,
                   index_t rsa, index_t csa, index_t rsb, index_t csb, index_t rsc, index_t csc, index_t batch,
                   const py::object& offa, const py::object& offb, const py::object& offc) {
    pyattn::GemmArgs g{m_, n, k, cptr(a), rsa, csa, cptr(b), rsb, csb, mptr(c), rsc, csc,
                       batch, offs(offa), offs(offb), offs(offc), pyattn::get_num_threads()};
    py::gil_scoped_release nogil;
    pyattn::active_isa().gemm[dt(c)](g);
  });

  m.def("softmax", [](const py::array& x, py::array& out, index_t rows, index_t n, const py::object& xoff,
                      index_t xcs, const py::object& ooff, index_t ocs, int mask_kind, const py::object& mask,
                      const py::object& moff, index_t mcs, double scale) {
    pyattn::SoftmaxArgs s{rows, n, cptr(x), offs(xoff), xcs, mptr(out), offs(ooff), ocs,
                          pyattn::MaskKind(mask_kind), opt_cptr(mask), offs(moff), mcs, scale,
                          pyattn::get_num_threads()};
    py::gil_scoped_release nogil;
    pyattn::active_isa().softmax[dt(out)](s);
  });

  m.def("attention", [](const py::array& q, const py::array& k, const py::array& v, py::array& out, index_t bh,
                        index_t Lq, index_t Lk, index_t E, index_t Ev, index_t group, const py::object& qoff,
                        index_t q_rs, const py::object& koff, index_t k_rs, const py::object& voff, index_t v_rs,
                        const py::object& ooff, index_t o_rs, int mask_kind, const py::object& mask,
                        const py::object& moff, index_t m_rs, index_t m_cs, const py::object& lse,
                        const py::object& lseoff, index_t lse_s, const py::object& weights,
                        const py::object& woff, index_t w_rs, double scale, int causal) {
    pyattn::AttnArgs a{bh, Lq, Lk, E, Ev, group,
                       cptr(q), offs(qoff), q_rs, cptr(k), offs(koff), k_rs, cptr(v), offs(voff), v_rs,
                       mptr(out), offs(ooff), o_rs,
                       pyattn::MaskKind(mask_kind), opt_cptr(mask), offs(moff), m_rs, m_cs,
                       opt_mptr(lse), offs(lseoff), lse_s,
                       opt_mptr(weights), offs(woff), w_rs,
                       scale, pyattn::Causal(causal), pyattn::get_num_threads()};
    py::gil_scoped_release nogil;
    pyattn::active_isa().attention[dt(out)](a);
  });

  m.def("isa", [] { return std::string(pyattn::active_isa().name); }, "Name of the kernel set in use.");
  m.def("set_isa", [](const std::string& name) { return pyattn::set_active_isa(name.c_str()); },
        "Switch kernel set (tests); returns False if this CPU cannot run it.");
  m.def("available_isas", [] {
    std::vector<std::string> out;
    for (const char* n : {"generic", "avx2", "avx512"})
      if (pyattn::isa_supported(n)) out.emplace_back(n);
    return out;
  });
  m.def("get_num_threads", &pyattn::get_num_threads);
  m.def("set_num_threads", &pyattn::set_num_threads);
  m.def("default_num_threads", &pyattn::default_num_threads);
  m.attr("compiler") = compiler();
#ifdef PYATTN_VERSION
  m.attr("__version__") = PYATTN_VERSION;
#endif
}
