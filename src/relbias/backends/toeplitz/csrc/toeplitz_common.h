// Helpers shared by the toeplitz backend's native kernels (toeplitz_forward.cpp, toeplitz_backward.cpp): the
// exported BLAS, a row-major GEMM over it (else at::addmm_out), a polynomial exp that GCC vectorises, argument checks.
#pragma once

#include <torch/extension.h>
#include <ATen/OpMathType.h>

#if defined(__SSE__) || defined(_M_X64)
#include <xmmintrin.h>
#endif
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

extern "C" {
// Fortran BLAS (column-major); weak so that a libtorch without them (no MKL / BLAS exported) still loads.
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*) __attribute__((weak));
// MKL's half-precision GEMMs with float32 accumulation and output (CBLAS: layout 101 row-major, transposes 111 no,
// 112 yes; MKL_BF16 and MKL_F16 are 16-bit integers holding the bits); weak, as above. On a CPU with AMX they run on
// its tiles.
void cblas_gemm_bf16bf16f32(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int, float,
                            float*, int) __attribute__((weak));
void cblas_gemm_f16f16f32(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int, float,
                          float*, int) __attribute__((weak));
}

namespace relbias_toeplitz {

// The widest vector register the build targets (bytes): AVX-512 64, AVX / AVX2 32, else 16 (SSE, NEON). Loops
// written in GCC vector extensions use it: a vector wider than the target's registers is split by GCC, and its
// compares and selects then ran scalar (the forward's bias-and-max pass 10x slower per score on AVX2).
#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif

constexpr double kExpFloor = -87.0;  // e^-87 = 1.6e-38: float32's smallest normals (as the Python version)

template <typename T>
inline T bits_to(typename std::conditional<sizeof(T) == 4, int32_t, int64_t>::type v) {
  T out;
  std::memcpy(&out, &v, sizeof(T));
  return out;
}

// exp(x) for x already clamped to [-87, hi] (hi: 88 for float, 709 for double): x = n ln2 + r, |r| <= ln2 / 2,
// exp(x) = 2^n p(r) with p a Taylor polynomial (float: degree Degree, 7 by default, relative error < 2e-7, or 5,
// < 3e-6, for probabilities rounded to bfloat16 (2^-9) or float16 (2^-11) afterwards; double: degree 13, < 1e-16
// before rounding). Plain arithmetic and bit casts, so GCC vectorises a loop of it at -O3 (no -ffast-math: the
// rounding trick (t + shifter) - shifter must not be reassociated). Always inlined: a call in the loop keeps it scalar
// (GCC's inliner gave up on it once the backward's row pass had eight instantiations).
template <int Degree = 7>
__attribute__((always_inline)) inline float exp_clamped(float x) {
  static_assert(Degree >= 1 && Degree <= 7, "a Taylor polynomial of degree 1 to 7");
  constexpr float kInverseFactorial[] = {1.0f, 1.0f, 0.5f, 1.0f / 6.0f, 1.0f / 24.0f, 1.0f / 120.0f, 1.0f / 720.0f,
                                         1.0f / 5040.0f};
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float t = x * 1.44269504088896341f + shifter;
  float n = t - shifter;
  float r = x - n * 0.693359375f;  // Cody-Waite: ln2 = 0.693359375 - 2.12194440e-4
  r = r + n * 2.12194440e-4f;
  float p = kInverseFactorial[Degree];  // Horner, highest degree first
  for (int i = Degree - 1; i >= 0; --i) p = p * r + kInverseFactorial[i];
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;  // n in [-126, 127]
  return p * bits_to<float>(e);
}

__attribute__((always_inline)) inline double exp_clamped(double x) {
  const double shifter = 6755399441055744.0;  // 1.5 * 2^52
  double t = x * 1.4426950408889634074 + shifter;
  double n = t - shifter;
  double r = x - n * 6.93147180369123816490e-01;  // fdlibm's ln2_hi, ln2_lo
  r = r - n * 1.90821492927058770002e-10;
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  int64_t e = (static_cast<int64_t>(n) + 1023) << 52;  // n in [-126, 1023]
  return p * bits_to<double>(e);
}

template <typename T> constexpr T exp_ceiling() { return sizeof(T) == 4 ? T(88) : T(709); }

// Denormals flushed to zero (and read as zero) on the calling thread while this lives, then the thread's own mode
// back: x86's MXCSR FTZ and DAZ bits, Arm's FPCR FZ bit; nothing elsewhere. Each kernel's parallel body holds one,
// so every thread that computes a tile flushes, at the cost of two register writes. Why: products of tiny
// probabilities (ALiBi's far keys) land in float32 denormals, on which x86 takes a slow microcode path (measured:
// forward 1.4x, backward 4x slower on ALiBi); such terms are below 2^-126 of the row's largest, under the
// resolution of the sums they enter, so flushing them changes no result beyond rounding.
class FlushDenormals {
 public:
  FlushDenormals() {
#if defined(__SSE__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
#elif defined(__aarch64__)
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t on = saved_ | (uint64_t(1) << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(on));
#endif
  }
  ~FlushDenormals() {
#if defined(__SSE__) || defined(_M_X64)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
#if defined(__aarch64__)
  uint64_t saved_ = 0;
#else
  unsigned int saved_ = 0;
#endif
};

// The dtype a kernel on In elements computes in: In itself for float and double, float for bfloat16 and float16
// (scores, softmax statistics, bias, output accumulator; ATen's opmath type).
template <typename In>
using acc_t = at::opmath_type<In>;

template <typename In>
constexpr bool is_half() { return !std::is_same<In, acc_t<In>>::value; }

// A per-thread buffer of n elements starting on a 64-byte boundary (a cache line: the BLAS and the matrix units'
// tile loads read whole lines, and the same code path runs every time). data() is the aligned start.
template <typename X>
class Aligned {
 public:
  explicit Aligned(int64_t n) : buf_(n + kSlack) {
    const auto address = reinterpret_cast<std::uintptr_t>(buf_.data());
    start_ = buf_.data() + (64 - address % 64) % 64 / sizeof(X);
  }
  X* data() { return start_; }

 private:
  static constexpr int64_t kSlack = 64 / sizeof(X);
  std::vector<X> buf_;
  X* start_;
};

// lanes[0] = the kLanes partials combined by op, halved log2(kLanes) times (lane l + width into lane l: a fixed order
// on every ISA). A template per width, so each level's loop has a constant trip count and the compiler unrolls it
// into register operations (a loop over the widths kept the partials in memory, with a store and a reload per level).
template <int Width, typename T, typename Op>
inline T halve_lanes(T* lanes, Op op) {
  if constexpr (Width == 0) {
    return lanes[0];
  } else {
    for (int l = 0; l < Width; ++l) lanes[l] = op(lanes[l], lanes[l + Width]);
    return halve_lanes<Width / 2>(lanes, op);
  }
}

// Row-major C (m x n, ldc) = alpha op(A) op(B) + beta C, op(A) (m x k), op(B) (k x n), A and B of In, C of T (In's
// accumulation type: float for bfloat16 and float16, exact products summed in float32). beta 0: C is not read. blas:
// the exported BLAS (MKL's sgemm_, dgemm_, cblas_gemm_bf16bf16f32, cblas_gemm_f16f16f32) where present, else
// at::addmm_out (float32 and float64; the half-precision kernels run only where have_blas says the GEMM is there).
template <typename In, typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const In* a, int64_t lda,
          const In* b, int64_t ldb, T beta, T* c, int64_t ldc, bool blas) {
  static_assert(std::is_same<T, acc_t<In>>::value, "C holds A's and B's accumulation type");
  if (m == 0 || n == 0) return;
  if (k == 0) {  // nothing to multiply: C = beta C
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
    return;
  }
  if constexpr (is_half<In>()) {
    auto* const fn = std::is_same<In, at::BFloat16>::value ? cblas_gemm_bf16bf16f32 : cblas_gemm_f16f16f32;
    TORCH_CHECK(fn != nullptr, "relbias: this libtorch exports no half-precision GEMM (MKL's cblas_gemm_*16*16f32)");
    fn(101, trans_a ? 112 : 111, trans_b ? 112 : 111, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
       alpha, reinterpret_cast<const uint16_t*>(a), static_cast<int>(lda), reinterpret_cast<const uint16_t*>(b),
       static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
    return;
  } else {
    if (blas) {
      // Column-major view: C^T (n x m) = op(B)^T op(A)^T, B^T's column-major storage being B's row-major one.
      const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
      const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
      const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
      if constexpr (std::is_same<T, float>::value) {
        sgemm_(&ta, &tb, &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
      } else {
        dgemm_(&ta, &tb, &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
      }
      return;
    }
    auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
    auto view = [&](const T* p, int64_t rows, int64_t cols, int64_t ld, bool trans) {
      at::Tensor t = at::from_blob(const_cast<T*>(p), {trans ? cols : rows, trans ? rows : cols}, {ld, 1}, options);
      return trans ? t.t() : t;
    };
    at::Tensor ct = at::from_blob(c, {m, n}, {ldc, 1}, options);
    at::addmm_out(ct, ct, view(a, m, k, lda, trans_a), view(b, k, n, ldb, trans_b), beta, alpha);
  }
}

// Whether the exported BLAS has the GEMM for this input dtype.
inline bool have_blas(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return sgemm_ != nullptr;
    case at::kDouble: return dgemm_ != nullptr;
    case at::kBFloat16: return cblas_gemm_bf16bf16f32 != nullptr;
    case at::kHalf: return cblas_gemm_f16f16f32 != nullptr;
    default: return false;
  }
}

// The bfloat16 bits (in the low half) of float32 bits, one uint32_t or a GCC vector of them, rounded to nearest even
// (torch's conversion; NaN to a quiet NaN): the upper half after adding the rounding bias, a select for NaN.
template <typename Bits>
inline Bits bf16_rounded(Bits bits) {
  const Bits rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? Bits{} + 0x7FC0u : rounded;
}

// dst[j] = src[j] rounded to In, j < n (round to nearest even, as torch's own conversions): bfloat16 by bf16_rounded,
// in GCC vector extensions of the target's register width (as a plain loop GCC kept it scalar), float16 by c10's
// conversion, float and double copied.
template <typename In, typename T>
inline void round_to(const T* __restrict__ src, In* __restrict__ dst, int64_t n) {
  if constexpr (std::is_same<In, at::BFloat16>::value) {
    constexpr int kLanes = kVectorBytes / sizeof(float);
    typedef uint32_t Bits __attribute__((vector_size(kVectorBytes)));
    typedef uint16_t Half __attribute__((vector_size(kVectorBytes / 2)));
    uint16_t* __restrict__ out = reinterpret_cast<uint16_t*>(dst);
    int64_t j = 0;
#if defined(__AVX512BF16__)
    // the CPU's own conversion (VCVTNEPS2BF16: the same rounding; denormal inputs read as 0, as the kernels' flushed
    // arithmetic reads them)
    for (; j + 16 <= n; j += 16) {
      const __m256bh half = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + j));
      std::memcpy(out + j, &half, sizeof(half));
    }
#endif
    for (; j + kLanes <= n; j += kLanes) {
      Bits bits;
      std::memcpy(&bits, src + j, sizeof(bits));
      const Half half = __builtin_convertvector(bf16_rounded(bits), Half);
      std::memcpy(out + j, &half, sizeof(half));
    }
    for (; j < n; ++j) {
      uint32_t bits;
      std::memcpy(&bits, src + j, sizeof(bits));
      out[j] = static_cast<uint16_t>(bf16_rounded(bits));
    }
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<In>(src[j]);
  }
}

// The strides the kernels read a tensor with: kContiguous (the backward's w), kRows (a (B, H, L, D) input: unit stride
// along D, rows at least D apart, any batch and head strides), kUnitLast (the forward's w: unit stride along its last
// dimension, any row stride: a view into a longer table), kAny (lse, grad_lse: (B, H, L)).
enum class Layout { kContiguous, kRows, kUnitLast, kAny };

inline bool rows_layout(const at::Tensor& t) {
  return (t.size(3) <= 1 || t.stride(3) == 1) && (t.size(2) <= 1 || t.stride(2) >= t.size(3));
}

inline void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                  Layout layout = Layout::kContiguous) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  // a negative view's sign is a flag on the tensor (torch._neg_view): the kernels read memory, so it must be applied
  TORCH_CHECK(!t.is_neg(), name, " must not be a negative view (resolve_neg() first)");
  if (layout == Layout::kContiguous) TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  if (layout == Layout::kRows)
    TORCH_CHECK(rows_layout(t), name, " must have unit stride along its last dimension and rows at least that long apart");
  if (layout == Layout::kUnitLast)
    TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name, " must have unit stride along its last dimension");
}

// Rows of a (B, H, L, D) tensor in the kRows layout: element (b, h, i, d) at (*this)(b * H + h) + i * ld + d. A slice
// along L, the transpose of a (B, L, H, D) projection and a broadcast batch or head are read in place, not copied.
template <typename T>
struct Rows {
  const T* p;
  int64_t s0, s1, heads, ld;
  explicit Rows(const at::Tensor& t)
      : p(t.data_ptr<T>()), s0(t.stride(0)), s1(t.stride(1)), heads(t.size(1)),
        ld(t.size(2) > 1 ? t.stride(2) : std::max<int64_t>(t.size(3), 1)) {}  // BLAS wants ld >= D even for one row
  const T* operator()(int64_t bh) const { return p + (bh / heads) * s0 + (bh % heads) * s1; }
};

// Entries of a (B, H, L) tensor with any strides: entry (b, h, i) at (*this)(b * H + h, i).
template <typename T>
struct Entries {
  const T* p;
  int64_t s0, s1, s2, heads;
  explicit Entries(const at::Tensor& t)
      : p(t.data_ptr<T>()), s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)), heads(t.size(1)) {}
  T operator()(int64_t bh, int64_t i) const { return p[(bh / heads) * s0 + (bh % heads) * s1 + i * s2]; }
};

// The accumulation dtype of an input dtype (acc_t's): float for bfloat16 and float16, else the dtype itself.
inline at::ScalarType acc_dtype(at::ScalarType dtype) {
  return dtype == at::kBFloat16 || dtype == at::kHalf ? at::kFloat : dtype;
}

// The checks both entry points (fn, for the messages) make of q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv)
// and w (1 or H, Lq + Lk - 1): q, k, v of one dtype, float32 or float64 (half_ok: also bfloat16 or float16), w of its
// accumulation dtype (acc_dtype), CPU, q, k, v in the kRows layout and w contiguous, shapes that agree. Returns the
// dtype of q.
inline at::ScalarType check_qkvw(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w,
                                 const char* fn, Layout w_layout = Layout::kContiguous, bool half_ok = false) {
  const auto dtype = q.scalar_type();
  const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || (half_ok && half), fn,
              half_ok ? ": float32, float64, bfloat16 or float16, got " : ": float32 or float64, got ", dtype);
  check(q, "query", dtype, 4, Layout::kRows);
  check(k, "key", dtype, 4, Layout::kRows);
  check(v, "value", dtype, 4, Layout::kRows);
  check(w, "w", acc_dtype(dtype), 2, w_layout);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && v.size(0) == B && v.size(1) == H && v.size(2) == Lk &&
                  k.size(3) == q.size(3), fn, ": query, key, value shapes disagree");
  TORCH_CHECK((w.size(0) == 1 || w.size(0) == H) && w.size(1) == Lq + Lk - 1, fn,
              ": w must be (1 or H, Lq + Lk - 1)");
  return dtype;
}

// The keys a query may see under the causal rule and a local-attention window (relbias.window): key s is visible to
// query t when t + delta - left <= s (left >= 0; -1: no bound) and s <= t + delta + right (right >= 0; the causal
// rule is right 0; -1 without either: no bound). [begin(t), end(t)) are those keys among the block's lk; a query tile
// [i0, i1) sees keys [begin(i0), end(i1 - 1)) at most.
struct Band {
  int64_t delta, left, right;
  Band(int64_t delta_, bool is_causal, int64_t left_, int64_t right_)
      : delta(delta_), left(left_), right(is_causal ? 0 : right_) {}
  int64_t begin(int64_t t, int64_t lk) const {
    return left < 0 ? 0 : std::min(lk, std::max<int64_t>(0, t + delta - left));
  }
  int64_t end(int64_t t, int64_t lk) const {
    return right < 0 ? lk : std::min(lk, std::max<int64_t>(0, t + delta + right + 1));
  }
  // [jbeg, jend) within a key tile of bk keys starting at key k0: the keys of the tile query t sees.
  void row(int64_t t, int64_t lk, int64_t k0, int64_t bk, int64_t& jbeg, int64_t& jend) const {
    jbeg = std::min(bk, std::max<int64_t>(0, begin(t, lk) - k0));
    jend = std::max(jbeg, std::min(bk, end(t, lk) - k0));
  }
};

// A key padding mask as an additive row per (b, h): kpad (Bm, Hm, Lk) contiguous, 0 for a key the queries may see
// and -inf for a padded one, Bm 1 or B, Hm 1 or H (a broadcast batch or head). (*this)(bh) is the row of b * H + h,
// or nullptr without a mask.
template <typename T>
struct KeyPadding {
  const T* p = nullptr;
  int64_t batches = 1, heads = 1, num_heads = 1, len = 0;
  KeyPadding(const c10::optional<at::Tensor>& kpad, int64_t H) : num_heads(H) {
    if (!kpad.has_value()) return;
    p = kpad->data_ptr<T>();
    batches = kpad->size(0);
    heads = kpad->size(1);
    len = kpad->size(2);
  }
  const T* operator()(int64_t bh) const {
    if (p == nullptr) return nullptr;
    const int64_t b = batches == 1 ? 0 : bh / num_heads, h = heads == 1 ? 0 : bh % num_heads;
    return p + (b * heads + h) * len;
  }
};

// Whether every key of a padding row's window [0, n) is padded (-inf): a tile the kernels skip.
template <typename T>
inline bool all_padded(const T* row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (row[j] != -std::numeric_limits<T>::infinity()) return false;
  }
  return true;
}

// Attention dropout with relbias' counter-based mask (relbias._dropout): entry (b, h, i, j) of a call is kept when
// lowbias32 applied after xoring in, in turn, the seed, b, h, the query's absolute position and the key's is at least
// threshold = floor(p 2^32); kept probabilities are multiplied by 1 / (1 - p). The same bits as the reference and
// blockwise backends draw, whatever the tiling.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

struct DropoutMask {
  bool on = false;
  uint32_t threshold = 0, seed_hash = 0;
  int64_t heads = 1, query_start = 0, key_start = 0;
  double keep_scale = 1.0;
  DropoutMask(double p, int64_t seed, int64_t query_start_, int64_t key_start_, int64_t H)
      : on(p > 0.0), heads(H), query_start(query_start_), key_start(key_start_) {
    if (!on) return;
    threshold = static_cast<uint32_t>(static_cast<uint64_t>(p * 4294967296.0));
    seed_hash = mix32(static_cast<uint32_t>(seed));
    keep_scale = 1.0 / (1.0 - p);
  }
  // The hash after b, h and query i (a row of (b, h) = bh): keys then xor in their positions.
  uint32_t row(int64_t bh, int64_t i) const {
    uint32_t x = mix32(seed_hash ^ static_cast<uint32_t>(bh / heads));
    x = mix32(x ^ static_cast<uint32_t>(bh % heads));
    return mix32(x ^ static_cast<uint32_t>(query_start + i));
  }
  uint32_t key_base(int64_t k0) const { return static_cast<uint32_t>(key_start + k0); }
};

// srow[j] *= (kept ? scale : 0) for the keys k0 + j, j < n, of a row whose hash is row_hash.
template <typename T>
inline void apply_dropout(T* __restrict__ srow, int64_t n, uint32_t row_hash, uint32_t key_base, uint32_t threshold,
                          T scale) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t x = mix32(row_hash ^ (key_base + static_cast<uint32_t>(j)));
    srow[j] = x >= threshold ? srow[j] * scale : T(0);
  }
}

// The keys a padding row leaves: [first, last) holds every kept key (first = n, last = 0 when none is kept), and
// interior says whether padded keys lie in between. Without interior padding (right or left padding, the common
// case) the kernels run the unpadded code on the keys [first, last) alone; with it, they add the row per entry.
struct PadRange {
  int64_t first, last;
  bool interior;
};

template <typename T>
inline PadRange pad_range(const T* row, int64_t n) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  int64_t first = 0, last = n;
  while (first < n && row[first] == neg_inf) ++first;
  while (last > first && row[last - 1] == neg_inf) --last;
  bool interior = false;
  for (int64_t j = first; j < last && !interior; ++j) interior = row[j] == neg_inf;
  if (first == n) last = 0;
  return {first, last, interior};
}

// The checks of an optional key padding mask kpad against q (B, H, Lq, D) and k (B, H, Lk, D) (fn, for messages).
inline void check_kpad(const c10::optional<at::Tensor>& kpad, const at::Tensor& q, const at::Tensor& k,
                       at::ScalarType dtype, const char* fn) {
  if (!kpad.has_value()) return;
  check(*kpad, "key padding", dtype, 3);
  TORCH_CHECK((kpad->size(0) == 1 || kpad->size(0) == q.size(0)) && (kpad->size(1) == 1 || kpad->size(1) == q.size(1))
                  && kpad->size(2) == k.size(2), fn, ": the key padding must be (1 or B, 1 or H, Lk)");
}

}  // namespace relbias_toeplitz

// Defined in toeplitz_forward.cpp; see there.
std::vector<at::Tensor> toeplitz_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& w, double scale, int64_t delta, bool is_causal,
                                         int64_t tile_q, int64_t tile_k, bool blas,
                                         const c10::optional<at::Tensor>& kpad, double dropout_p, int64_t seed,
                                         int64_t query_start, int64_t key_start, int64_t window_left,
                                         int64_t window_right);
