// A repeated decoding call's native forward: the decode backend's repeat runner (relbias.backends.decode,
// _native_runner). The arguments that follow from the call's signature (the reversed bias, scale, positions, tiles,
// window) are kept in a ForwardRepeat; each call checks in C++ what it must read again (RELBIAS_NATIVE, the inputs'
// strides) and runs toeplitz_forward (toeplitz_forward.cpp): one Python call where a decoding layer made three (the
// strides, the opt-out, the kernel with its 17 arguments). Inside a model every Python step runs with cold caches and
// costs several times what it costs in a loop (docs/performance.md, decoding). Python's checks stay the definition:
// where this one cannot decide, it answers None and the caller takes the Python path.

#include "toeplitz_common.h"

#include <cstdlib>
#include <vector>

std::vector<at::Tensor> toeplitz_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& w, double scale, int64_t delta, bool is_causal,
                                         int64_t tile_q, int64_t tile_k, bool blas,
                                         const c10::optional<at::Tensor>& kpad, double dropout_p, int64_t seed,
                                         int64_t query_start, int64_t key_start, int64_t window_left,
                                         int64_t window_right);

namespace {

// Whether RELBIAS_NATIVE leaves the native kernels on, as relbias.backends.toeplitz._native reads it (on unless
// the value, stripped of whitespace, is "0"): 1 on (unset, or a value of printable ASCII other than "0" with
// spaces or tabs around it), 0 off, -1 undecided here (another byte: Python's str.strip knows more whitespace).
int native_enabled() {
  const char* value = std::getenv("RELBIAS_NATIVE");
  if (value == nullptr) return 1;
  const char* begin = value;
  const char* end = value + std::strlen(value);
  for (const char* c = begin; c < end; ++c)
    if ((*c < ' ' && *c != '\t') || static_cast<unsigned char>(*c) > '~') return -1;
  while (begin < end && (*begin == ' ' || *begin == '\t')) ++begin;
  while (end > begin && (end[-1] == ' ' || end[-1] == '\t')) --end;
  return end - begin == 1 && *begin == '0' ? 0 : 1;
}

// relbias.backends.toeplitz._native.read_in_place for one (B, H, L, D) tensor: unit stride along D and rows at
// least D apart (any other layout would need a copy).
bool read_in_place(const at::Tensor& t) {
  if (t.dim() != 4) return false;
  if (t.is_contiguous()) return true;
  const int64_t length = t.size(2), dim = t.size(3);
  return (dim <= 1 || t.stride(3) == 1) && (length <= 1 || t.stride(2) >= dim);
}

}  // namespace

// The native forward of one signature's repeats: (out, lse) = toeplitz_forward(q, k, v, w, ...) with no key
// padding and no dropout, or None where the Python path must decide (RELBIAS_NATIVE set to 0 or to a value this
// reading leaves undecided; an input the kernel would not read in place).
class ForwardRepeat {
 public:
  ForwardRepeat(at::Tensor w, double scale, int64_t delta, bool is_causal, int64_t tile_q, int64_t tile_k,
                bool blas, int64_t window_left, int64_t window_right)
      : w_(std::move(w)), scale_(scale), delta_(delta), is_causal_(is_causal), tile_q_(tile_q), tile_k_(tile_k),
        blas_(blas), window_left_(window_left), window_right_(window_right) {}

  pybind11::object operator()(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const {
    if (native_enabled() != 1 || !read_in_place(q) || !read_in_place(k) || !read_in_place(v))
      return pybind11::none();
    std::vector<at::Tensor> result;
    {
      pybind11::gil_scoped_release release;
      result = toeplitz_forward(q, k, v, w_, scale_, delta_, is_causal_, tile_q_, tile_k_, blas_, c10::nullopt, 0.0,
                                0, 0, 0, window_left_, window_right_);
    }
    return pybind11::make_tuple(result[0], result[1]);
  }

 private:
  at::Tensor w_;
  double scale_;
  int64_t delta_;
  bool is_causal_;
  int64_t tile_q_, tile_k_;
  bool blas_;
  int64_t window_left_, window_right_;
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
