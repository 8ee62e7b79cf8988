// A repeated decoding call's native forward: the decode backend's repeat runner (relbias.backends.decode,
// _native_runner). The arguments that follow from the call's signature (the reversed bias, scale, positions, tiles,
// window) are kept in a ForwardRepeat; each call checks in C++ what it must read again (RELBIAS_NATIVE, the inputs'
// strides) and runs toeplitz_forward (toeplitz_forward.cpp): one Python call where a decoding layer made three (the
// strides, the opt-out, the kernel with its 17 arguments). Inside a model every Python step runs with cold caches and
// costs several times what it costs in a loop (docs/performance.md, decoding). Python's checks stay the definition:
// where this one cannot decide, it answers None and the caller takes the Python path.

#include "toeplitz_common.h"  // declares toeplitz_forward

#include <vector>

namespace {

namespace py = pybind11;

// Whether an ASCII byte is whitespace to Python's str.strip (str.isspace): \t \n \v \f \r, \x1c-\x1f, space.
bool py_space(char c) { return (c >= '\t' && c <= '\r') || (c >= '\x1c' && c <= ' '); }

// relbias.backends.toeplitz._native's reading of a RELBIAS_NATIVE value (on unless, stripped, it is "0") for the
// bytes os.environ holds: 1 on, 0 off, -1 undecided here (a byte outside ASCII: Python decodes it and its strip knows
// more whitespace).
int enabled_by(const char* value, Py_ssize_t size) {
  for (Py_ssize_t i = 0; i < size; ++i)
    if (static_cast<unsigned char>(value[i]) > 0x7f) return -1;
  const char *begin = value, *end = value + size;
  while (begin < end && py_space(*begin)) ++begin;
  while (end > begin && py_space(end[-1])) --end;
  return end - begin == 1 && *begin == '0' ? 0 : 1;
}

// relbias.backends.toeplitz._native.read_in_place for one (B, H, L, D) tensor: not a negative view, and the kernels'
// rows layout (toeplitz_common.h): any other would need a copy.
bool read_in_place(const at::Tensor& t) { return t.dim() == 4 && !t.is_neg() && relbias_toeplitz::rows_layout(t); }

}  // namespace

// The native forward of one signature's repeats: (out, lse) = toeplitz_forward(q, k, v, w, ...) with no key
// padding and no dropout, or None where the Python path must decide (RELBIAS_NATIVE set to 0, or read here other than
// as Python reads it; an input the kernel would not read in place).
class ForwardRepeat {
 public:
  ForwardRepeat(at::Tensor w, double scale, int64_t delta, bool is_causal, int64_t tile_q, int64_t tile_k,
                bool blas, int64_t window_left, int64_t window_right)
      : w_(std::move(w)), scale_(scale), delta_(delta), is_causal_(is_causal), tile_q_(tile_q), tile_k_(tile_k),
        blas_(blas), window_left_(window_left), window_right_(window_right), os_(py::module_::import("os")),
        name_("RELBIAS_NATIVE"), environ_name_("environ"), data_name_("_data") {
    // POSIX CPython: os.environ is an os._Environ whose _data dict holds the encoded names and values it reads
    if (os_.attr("name").cast<std::string>() == "posix" && py::hasattr(os_, "_Environ"))
      environ_type_ = os_.attr("_Environ");
  }

  py::object operator()(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const {
    if (native_enabled() != 1 || !read_in_place(q) || !read_in_place(k) || !read_in_place(v)) return py::none();
    std::vector<at::Tensor> result;
    {
      py::gil_scoped_release release;
      result = toeplitz_forward(q, k, v, w_, scale_, delta_, is_causal_, tile_q_, tile_k_, blas_, c10::nullopt, 0.0,
                                0, 0, 0, window_left_, window_right_);
    }
    return py::make_tuple(result[0], result[1]);
  }

 private:
  // RELBIAS_NATIVE as os.environ.get reads it, from os.environ's own table without running Python (os.environ as it
  // stands now: a mapping put in its place, or a platform without that table, answers -1): 1 on, 0 off, -1 undecided.
  int native_enabled() const {
    if (!environ_type_) return -1;
    PyObject* environ = PyObject_GetAttr(os_.ptr(), environ_name_.ptr());
    if (environ == nullptr) {
      PyErr_Clear();
      return -1;
    }
    PyObject* data = Py_TYPE(environ) == reinterpret_cast<PyTypeObject*>(environ_type_.ptr())
                         ? PyObject_GetAttr(environ, data_name_.ptr())
                         : nullptr;
    Py_DECREF(environ);
    if (data == nullptr) {
      PyErr_Clear();
      return -1;
    }
    int enabled = -1;
    if (PyDict_CheckExact(data)) {
      PyObject* value = PyDict_GetItemWithError(data, name_.ptr());  // borrowed
      if (value != nullptr)
        enabled = PyBytes_CheckExact(value) ? enabled_by(PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value)) : -1;
      else
        enabled = PyErr_Occurred() ? -1 : 1;  // unset: on
      PyErr_Clear();
    }
    Py_DECREF(data);
    return enabled;
  }

  at::Tensor w_;
  double scale_;
  int64_t delta_;
  bool is_causal_;
  int64_t tile_q_, tile_k_;
  bool blas_;
  int64_t window_left_, window_right_;
  py::module_ os_;
  py::bytes name_;
  py::str environ_name_, data_name_;  // the attribute names, made once (GetAttrString makes one per call)
  py::object environ_type_;  // os._Environ where its table can be read, else None
};

void bind_repeat(pybind11::module_& m) {
  pybind11::class_<ForwardRepeat>(m, "ForwardRepeat",
                                  "a repeated decoding call's native forward (toeplitz_repeat.cpp): "
                                  "ForwardRepeat(w, scale, delta, is_causal, tile_q, tile_k, blas, window_left, "
                                  "window_right)(q, k, v) -> (out, lse) or None")
      .def(pybind11::init<at::Tensor, double, int64_t, bool, int64_t, int64_t, bool, int64_t, int64_t>(),
           pybind11::arg("w"), pybind11::arg("scale"), pybind11::arg("delta"), pybind11::arg("is_causal"),
           pybind11::arg("tile_q"), pybind11::arg("tile_k"), pybind11::arg("blas"), pybind11::arg("window_left"),
           pybind11::arg("window_right"))
      .def("__call__", &ForwardRepeat::operator(), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"));
}
