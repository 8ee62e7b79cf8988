// The toeplitz backend's backward with a bias gradient, fused: dq, dk, dv and the gradient of the reversed bias
// in one tiled pass (FlashAttention-2 backward, Dao 2023, Alg. 2). Same math and outputs as the Python
// relbias.backends.toeplitz._backward.tiled_backward; built and loaded by relbias.backends.toeplitz._native.
//
// For query i and key j the bias is w[Lq - 1 - i + j] (w: the reversed, scaled per-offset values, (Hb, Lq+Lk-1)),
// so one query row reads, and its bias gradient adds into, a contiguous window of w. Per (query tile, key tile):
//
//   S  = scale q k^T                          (GEMM)
//   dP = dO v^T                               (GEMM)
//   P  = exp(max(S + w - lse, -87)),  dS = P * (dP - D),  dw[Lq-1-i+j] += dS_ij    (one fused pass)
//   dv += P^T dO,  dq += scale dS k,  dk += scale dS^T q                        (GEMMs)
//
// with D_i = dO_i . O_i - grad_lse_i. P is exactly 0 for a causal call's future keys (j > i + delta), for keys
// outside a local-attention window (Band, toeplitz_common.h: their tiles are skipped), for keys a
// key padding mask pads (an additive row per (b, h), 0 or -inf: x = S + w + pad - lse) and for queries whose lse is
// -inf (they see no key); such entries add nothing to any gradient, and key tiles whose keys are all padded are
// skipped. With attention dropout (mask Z, 0 or 1 / (1 - p), regenerated from its counter: toeplitz_common.h),
// dv += (P Z)^T dO and dS = P * (dP Z - D), D_i = dO_i . O_i of the dropped output (FlashAttention-2 with
// dropout, Dao 2023).
//
// Parallel over B*H: each task owns its dq, dk, dv rows and its own bias-gradient row, and the rows are summed over
// batch (and heads, for a bias shared by every head) in a fixed order afterwards, so results are bit-identical
// across runs (and across thread counts, as far as the BLAS is: measured so with MKL). GEMMs run inside a task,
// single-threaded while nested OpenMP is off (the default): sgemm_/dgemm_ that libtorch_cpu exports when built
// with MKL, else at::addmm_out on tile views. bfloat16 and float16 inputs: the GEMMs take them as they are (MKL's
// cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32, float32 accumulation), P and dS rounded to the dtype for the three
// gradient GEMMs (as FlashAttention's half-precision backward), everything else in float32; and D_i = sum_j (P Z)_ij
// dP_ij - grad_lse_i from a first pass over the query tile's key tiles (two GEMMs and the exp per tile), not dO . O:
// the output the forward returned was formed from P rounded to the dtype, and a D that misses this P by that rounding
// shifts every dS of the row, which the bias gradient sums. Denormals: flushed on
// every worker while it runs (FlushDenormals, toeplitz_common.h; dS and the GEMMs can meet them); exp's clamp at
// -87 keeps P normal.
//
// One extension module with toeplitz_forward.cpp (the fused forward) and toeplitz_repeat.cpp (a repeated decoding
// call's entry to it, bound by bind_repeat); the shared helpers (BLAS, GEMM, exp, checks)
// are in toeplitz_common.h, and this file holds the module's Python bindings, at its end.

#include "toeplitz_common.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace relbias_toeplitz;

// Query rows add their dS into kSpread separate bias-gradient rows (row i into i % kSpread). Row i + 1's window is
// row i's shifted by one element, so adding both into one buffer makes every vector load overlap stores of the row
// before, still in the store buffer: failed store forwarding made the fused pass 10x slower (measured: as long as
// the five GEMMs). kSpread rows apart, those stores have retired.
constexpr int64_t kSpread = 8;

// One query row's pass over its visible keys j < n: P = exp(S + w - lse), the exponent clamped to [floor, ceiling]
// (Padded: times keep[j], 1 for a key the row may see and 0 for a padded one, so P is exactly 0 there); Dropout: the
// mask Z regenerated (keep_scale where the key's hash is at least threshold, else 0). Then srow[j] = P Z,
// prow[j] = dS = P (dP Z - D) and grow[j] += dS; DotOnly: prow[j] = (P Z)_j dP_j alone (D's terms: row_sum adds
// them), nothing else written. Branch-free in j so that GCC vectorises it: a test of the padding row or a choice
// between two loads inside the loop left it scalar, and the pass as long as two of the GEMMs.
template <bool Padded, bool Dropout, bool DotOnly, typename T>
inline void probs_and_grads(T* __restrict__ srow, T* __restrict__ prow, T* __restrict__ grow,
                            const T* __restrict__ wrow, const T* __restrict__ keep, int64_t n, T l, T dd, T floor,
                            T ceiling, uint32_t row_hash, uint32_t key_base, uint32_t threshold, T keep_scale) {
  for (int64_t j = 0; j < n; ++j) {
    T x = srow[j] + wrow[j] - l;
    x = x < floor ? floor : x;
    x = x > ceiling ? ceiling : x;
    T p = exp_clamped(x);
    if constexpr (Padded) p = p * keep[j];
    T dp = prow[j];
    if constexpr (Dropout) {
      const uint32_t h = mix32(row_hash ^ (key_base + static_cast<uint32_t>(j)));
      const T z = h >= threshold ? keep_scale : T(0);
      dp = dp * z;
      if constexpr (!DotOnly) srow[j] = p * z;
    } else if constexpr (!DotOnly) {
      srow[j] = p;
    }
    if constexpr (DotOnly) {
      prow[j] = p * dp;
    } else {
      const T ds = p * (dp - dd);
      prow[j] = ds;
      grow[j] += ds;
    }
  }
}

// The sum of x[j], j < n, in T: 64 bytes of lanes (as the forward's exp_sum) combined in a fixed order, then the tail.
template <typename T>
inline T row_sum(const T* __restrict__ x, int64_t n) {
  constexpr int kLanes = 64 / sizeof(T);
  T part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += x[j + l];
  T sum = j > 0 ? halve_lanes<kLanes / 2>(part, [](T a, T b) { return a + b; }) : T(0);
  for (; j < n; ++j) sum += x[j];
  return sum;
}

// The rows of a tile's P or dS (bq x bk of T, leading dimension tile) as the GEMMs' In operand: the buffer itself
// for float and double, else rounded to In into half (as FlashAttention's half-precision backward rounds P and dS).
template <typename In, typename T>
inline const In* gemm_operand(const T* src, In* half, int64_t bq, int64_t bk, int64_t tile) {
  if constexpr (is_half<In>()) {
    for (int64_t a = 0; a < bq; ++a) round_to<In, T>(src + a * tile, half + a * tile, bk);
    return half;
  } else {
    return src;
  }
}

// In: the inputs' element type; T = acc_t<In> holds everything else (scores, P, dS, the bias and its gradient, lse,
// the dq, dk, dv accumulators): the GEMMs multiply In operands with T accumulation, P and dS rounded to In for theirs.
template <typename In>
void backward_kernel(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& grad_lse,
                     const at::Tensor& w, const c10::optional<at::Tensor>& kpad, const DropoutMask& dropout,
                     double scale_d, const Band& band, int64_t tile, bool blas, at::Tensor& dq,
                     at::Tensor& dk, at::Tensor& dv, at::Tensor& grad_w) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Dk = q.size(3);
  const int64_t Lk = k.size(2), Dv = v.size(3);
  const int64_t Hb = w.size(0), M = w.size(1);
  const int64_t BH = B * H;
  using T = acc_t<In>;
  const T scale = static_cast<T>(scale_d);
  const T floor = static_cast<T>(kExpFloor), ceiling = exp_ceiling<T>();
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const T keep_scale = static_cast<T>(dropout.keep_scale);

  const Rows<In> do_rows(dout), q_rows(q), k_rows(k), v_rows(v), o_rows(out);  // read in place, any batch/head/row strides
  const int64_t do_ld = do_rows.ld, q_ld = q_rows.ld, k_ld = k_rows.ld, v_ld = v_rows.ld, o_ld = o_rows.ld;
  const Entries<T> lse_at(lse);
  const KeyPadding<T> pad_rows(kpad, H);
  const c10::optional<Entries<T>> glse_at = grad_lse.has_value() ? c10::optional<Entries<T>>(Entries<T>(*grad_lse))
                                                                   : c10::nullopt;
  const T* w_p = w.data_ptr<T>();
  T* dq_p = dq.data_ptr<T>();
  T* dk_p = dk.data_ptr<T>();
  T* dv_p = dv.data_ptr<T>();

  // One bias-gradient row per (b, h), zeroed: summed in a fixed order below.
  at::Tensor rows = at::zeros({BH, M}, w.options());
  T* rows_p = rows.data_ptr<T>();

  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;  // this thread's mode, restored when the chunk is done
    std::vector<T> s_buf(tile * tile), dp_buf(tile * tile), row_d(tile), row_e(tile), row_lse(tile);
    std::vector<T> acc_buf(kSpread * M);
    std::vector<T> keep_buf(kpad.has_value() ? Lk : 0);  // a padding row with padding inside its kept range: 1 or 0
    std::vector<In> half_buf(is_half<In>() ? tile * tile : 0);  // P, then dS, rounded to In
    T* S = s_buf.data();   // scores, then P
    T* dP = dp_buf.data(); // dO v^T, then dS
    T* acc = acc_buf.data();  // kSpread bias-gradient rows: query i adds into row i % kSpread
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t hb = Hb == 1 ? 0 : bh % H;
      const T* wr = w_p + hb * M;
      T* gr = rows_p + bh * M;  // the sum of the kSpread rows of acc, once the task's tiles are done
      const In* qb = q_rows(bh);
      const In* dob = do_rows(bh);
      const In* ob = o_rows(bh);
      const In* kb = k_rows(bh);
      const In* vb = v_rows(bh);
      const T* pad = pad_rows(bh);  // nullptr without a key padding mask
      int64_t kbeg = 0, klast = Lk;  // the kept keys' range; the row itself only where padding lies inside it
      const T* keep = nullptr;  // 1 for a kept key, 0 for a padded one, where padding lies inside that range
      if (pad != nullptr) {
        const PadRange range = pad_range(pad, Lk);
        kbeg = range.first;
        klast = range.last;
        if (!range.interior) {
          pad = nullptr;
        } else {
          for (int64_t j = 0; j < Lk; ++j) keep_buf[j] = pad[j] == neg_inf ? T(0) : T(1);
          keep = keep_buf.data();
        }
      }
      T* dqb = dq_p + bh * Lq * Dk;
      T* dkb = dk_p + bh * Lk * Dk;
      T* dvb = dv_p + bh * Lk * Dv;
      for (int64_t i0 = 0; i0 < Lq; i0 += tile) {
        const int64_t i1 = std::min(Lq, i0 + tile), bq = i1 - i0;
        const int64_t kfirst = std::max(kbeg, band.begin(i0, Lk));  // the keys some row of the tile sees
        const int64_t kend = std::min(klast, band.end(i1 - 1, Lk));
        if (kend <= kfirst) continue;
        bool any_row = false;
        for (int64_t a = 0; a < bq; ++a) {  // D_i = dO_i . O_i - grad_lse_i; lse -inf: the row sees no key
          const int64_t i = i0 + a;
          const T l = lse_at(bh, i);
          row_lse[a] = l;
          if (l == neg_inf) continue;
          any_row = true;
          if constexpr (is_half<In>()) continue;  // D from the key tiles below
          const In* dor = dob + i * do_ld;
          const In* orow = ob + i * o_ld;
          T dot = 0;
          for (int64_t d = 0; d < Dv; ++d) dot += static_cast<T>(dor[d]) * static_cast<T>(orow[d]);
          row_d[a] = glse_at ? dot - (*glse_at)(bh, i) : dot;
        }
        if (!any_row) continue;
        const In* qt = qb + i0 * q_ld;
        const In* dot_ = dob + i0 * do_ld;
        // The key tiles: kDot, D's pass (half precision: D_i = sum_j (P Z)_ij dP_ij - grad_lse_i from the P this
        // backward forms; dO . O would read the output the forward rounded, P included, and a D off by the dtype's
        // eps shifts every dS of the row, which the bias gradient sums); else the gradients' pass.
        auto key_tiles = [&](auto dot_only) {
          constexpr bool kDot = decltype(dot_only)::value;
          for (int64_t k0 = kfirst; k0 < kend; k0 += tile) {
            const int64_t k1 = std::min(kend, k0 + tile), bk = k1 - k0;
            if (pad != nullptr && all_padded(pad + k0, bk)) continue;  // P = 0 for every entry: nothing to add
            const In* kt = kb + k0 * k_ld;
            const In* vt = vb + k0 * v_ld;
            gemm<In, T>(false, true, bq, bk, Dk, scale, qt, q_ld, kt, k_ld, T(0), S, tile, blas);
            gemm<In, T>(false, true, bq, bk, Dv, T(1), dot_, do_ld, vt, v_ld, T(0), dP, tile, blas);
            for (int64_t a = 0; a < bq; ++a) {
              const int64_t i = i0 + a;
              T* __restrict__ srow = S + a * tile;
              T* __restrict__ prow = dP + a * tile;
              int64_t jbeg = 0, jend = 0;  // keys k0 + j, jbeg <= j < jend, are visible to query i
              if (row_lse[a] != neg_inf) band.row(i, Lk, k0, bk, jbeg, jend);
              const T l = row_lse[a], dd = row_d[a];
              const T* __restrict__ wrow = wr + (Lq - 1 - i + k0 + jbeg);
              T* __restrict__ grow = acc + (i % kSpread) * M + (Lq - 1 - i + k0 + jbeg);
              const T* keep_row = keep == nullptr ? nullptr : keep + k0 + jbeg;
              const uint32_t row_hash = dropout.on ? dropout.row(bh, i) : 0u, key_base = dropout.key_base(k0 + jbeg);
              auto pass = [&](auto padded, auto dropped) {  // the instantiation for this row's padding and dropout
                probs_and_grads<decltype(padded)::value, decltype(dropped)::value, kDot>(
                    srow + jbeg, prow + jbeg, grow, wrow, keep_row, jend - jbeg, l, dd, floor, ceiling, row_hash,
                    key_base, dropout.threshold, keep_scale);
              };
              if (keep_row != nullptr) {
                dropout.on ? pass(std::true_type{}, std::true_type{}) : pass(std::true_type{}, std::false_type{});
              } else {
                dropout.on ? pass(std::false_type{}, std::true_type{}) : pass(std::false_type{}, std::false_type{});
              }
              if constexpr (kDot) {
                row_e[a] += row_sum(prow + jbeg, jend - jbeg);
                continue;
              }
              for (int64_t j = 0; j < jbeg; ++j) {
                srow[j] = T(0);
                prow[j] = T(0);
              }
              for (int64_t j = jend; j < bk; ++j) {
                srow[j] = T(0);
                prow[j] = T(0);
              }
            }
            if constexpr (kDot) continue;
            const In* p_in = gemm_operand<In, T>(S, half_buf.data(), bq, bk, tile);
            gemm<In, T>(true, false, bk, Dv, bq, T(1), p_in, tile, dot_, do_ld, T(1), dvb + k0 * Dv, Dv, blas);
            const In* ds_in = gemm_operand<In, T>(dP, half_buf.data(), bq, bk, tile);  // P's rounding is used: reuse
            gemm<In, T>(false, false, bq, Dk, bk, scale, ds_in, tile, kt, k_ld, T(1), dqb + i0 * Dk, Dk, blas);
            gemm<In, T>(true, false, bk, Dk, bq, scale, ds_in, tile, qt, q_ld, T(1), dkb + k0 * Dk, Dk, blas);
          }
        };
        if constexpr (is_half<In>()) {
          std::fill(row_e.begin(), row_e.begin() + bq, T(0));
          key_tiles(std::true_type{});
          for (int64_t a = 0; a < bq; ++a) row_d[a] = glse_at ? row_e[a] - (*glse_at)(bh, i0 + a) : row_e[a];
        }
        key_tiles(std::false_type{});
      }
      for (int64_t r = 0; r < kSpread; ++r) {  // fixed order; acc zeroed for the next (b, h)
        T* __restrict__ src = acc + r * M;
        for (int64_t m = 0; m < M; ++m) {
          gr[m] += src[m];
          src[m] = T(0);
        }
      }
    }
  });

  // grad_w[hb, m] = sum over b (and h, for a shared bias) of the rows, in order b, h: deterministic.
  T* gw_p = grad_w.data_ptr<T>();
  at::parallel_for(0, M, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t hb = 0; hb < Hb; ++hb) {
      T* dst = gw_p + hb * M;
      for (int64_t m = begin; m < end; ++m) dst[m] = T(0);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          if (Hb != 1 && h != hb) continue;
          const T* src = rows_p + (b * H + h) * M;
          for (int64_t m = begin; m < end; ++m) dst[m] += src[m];
        }
      }
    }
  });
}

}  // namespace

// (dq, dk, dv, grad_w) for the toeplitz forward; see the file's head. Shapes: dout, q, out (B, H, Lq, D·);
// k, v (B, H, Lk, D·); lse and grad_lse (B, H, Lq); w (Hb, Lq + Lk - 1) with Hb 1 or H; CPU tensors: dout, q, k, v,
// out of one dtype, float32, float64, bfloat16 or float16, with unit stride along D (other strides read in place);
// lse, grad_lse (any strides), w (contiguous) and kpad in its accumulation dtype (float32 for the half-precision
// ones, whose GEMMs need the exported cblas_gemm_*16*16f32). Outputs contiguous: dq, dk, dv in the inputs' dtype
// (accumulated in float32 for half precision), grad_w in w's. blas: call the exported BLAS directly (when present)
// instead of at::addmm_out. kpad, dropout_p, seed, query_start, key_start, window_left,
// window_right: as toeplitz_forward's (out is then the dropped output the forward returned).
std::vector<at::Tensor> toeplitz_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                          const c10::optional<at::Tensor>& grad_lse, const at::Tensor& w,
                                          double scale, int64_t delta, bool is_causal, int64_t tile, bool blas,
                                          const c10::optional<at::Tensor>& kpad, double dropout_p, int64_t seed,
                                          int64_t query_start, int64_t key_start, int64_t window_left,
                                          int64_t window_right) {
  const auto dtype = check_qkvw(q, k, v, w, "toeplitz_backward", Layout::kContiguous, /*half_ok=*/true);
  const auto acc = acc_dtype(dtype);
  TORCH_CHECK(window_left >= -1 && window_right >= -1, "toeplitz_backward: window sides must be >= 0, or -1 (none)");
  const Band band(delta, is_causal, window_left, window_right);
  check_kpad(kpad, q, k, acc, "toeplitz_backward");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "toeplitz_backward: dropout_p must be in [0, 1)");
  const DropoutMask dropout(dropout_p, seed, query_start, key_start, q.size(1));
  check(dout, "grad_out", dtype, 4, Layout::kRows);
  check(out, "out", dtype, 4, Layout::kRows);
  check(lse, "lse", acc, 3, Layout::kAny);
  if (grad_lse.has_value()) check(*grad_lse, "grad_lse", acc, 3, Layout::kAny);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2);
  TORCH_CHECK(dout.sizes() == out.sizes() && out.size(0) == B && out.size(1) == H && out.size(2) == Lq &&
                  out.size(3) == v.size(3), "toeplitz_backward: grad_out and out must be (B, H, Lq, Dv)");
  TORCH_CHECK(lse.size(0) == B && lse.size(1) == H && lse.size(2) == Lq, "toeplitz_backward: lse must be (B, H, Lq)");
  if (grad_lse.has_value()) TORCH_CHECK(grad_lse->sizes() == lse.sizes(), "toeplitz_backward: grad_lse like lse");
  TORCH_CHECK(tile > 0, "toeplitz_backward: tile must be positive");
  const int64_t big = std::numeric_limits<int>::max();
  blas = blas && have_blas(dtype) && q.size(3) < big && v.size(3) < big && tile < big;
  for (const at::Tensor* t : {&dout, &q, &k, &v, &out}) blas = blas && t->stride(2) < big;  // int leading dimensions
  TORCH_CHECK(blas || acc == dtype, "toeplitz_backward: ", dtype, " needs the exported half-precision GEMM with "
              "int-sized leading dimensions (relbias runs it on float32 copies elsewhere)");
  // contiguous whatever the inputs' strides (zeros_like keeps a permuted input's strides; the indexing below does not);
  // accumulated in acc, returned in the inputs' dtype
  const auto options = q.options().dtype(acc);
  at::Tensor dq = at::zeros(q.sizes(), options), dk = at::zeros(k.sizes(), options);
  at::Tensor dv = at::zeros(v.sizes(), options), grad_w = at::empty_like(w);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "toeplitz_backward", [&] {
    backward_kernel<scalar_t>(dout, q, k, v, out, lse, grad_lse, w, kpad, dropout, scale, band, tile, blas, dq, dk,
                              dv, grad_w);
  });
  if (acc != dtype) return {dq.to(dtype), dk.to(dtype), dv.to(dtype), grad_w};
  return {dq, dk, dv, grad_w};
}

bool has_blas() { return sgemm_ != nullptr && dgemm_ != nullptr; }

// Whether the forward runs inputs of this dtype ("bfloat16" or "float16") in half precision on this machine: the
// exported GEMM for it (have_blas) and the CPU's matrix units for it as oneDNN sees them (AMX-BF16, AMX-FP16: ATen's
// cpublas::could_pack, which ONEDNN_MAX_CPU_ISA and torch.backends.mkldnn's switch lower), as ATen's own CPU flash
// attention packs for them. Elsewhere a half-precision GEMM is no faster than float32's (without AMX) or much
// slower (AVX2: converted in software), and the caller runs float32 copies.
bool half_precision(const std::string& dtype) {
  TORCH_CHECK(dtype == "bfloat16" || dtype == "float16", "half_precision: 'bfloat16' or 'float16', got '", dtype,
              "'");
  const at::ScalarType type = dtype == "bfloat16" ? at::kBFloat16 : at::kHalf;
  return have_blas(type) && at::native::cpublas::could_pack(type);
}

void bind_repeat(pybind11::module_& m);  // toeplitz_repeat.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("toeplitz_backward", &toeplitz_backward, "toeplitz backward with a bias gradient (dq, dk, dv, grad_w)",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
        py::arg("grad_lse"), py::arg("w"), py::arg("scale"), py::arg("delta"), py::arg("is_causal"), py::arg("tile"),
        py::arg("blas"), py::arg("kpad") = py::none(), py::arg("dropout_p") = 0.0, py::arg("seed") = 0,
        py::arg("query_start") = 0, py::arg("key_start") = 0, py::arg("window_left") = -1,
        py::arg("window_right") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("toeplitz_forward", &toeplitz_forward, "toeplitz forward (out, lse), fused (toeplitz_forward.cpp)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("w"), py::arg("scale"), py::arg("delta"),
        py::arg("is_causal"), py::arg("tile_q"), py::arg("tile_k"), py::arg("blas"), py::arg("kpad") = py::none(),
        py::arg("dropout_p") = 0.0, py::arg("seed") = 0, py::arg("query_start") = 0, py::arg("key_start") = 0,
        py::arg("window_left") = -1, py::arg("window_right") = -1, py::call_guard<py::gil_scoped_release>());
  bind_repeat(m);
  m.def("has_blas", &has_blas, "whether libtorch exports sgemm_ and dgemm_ (else GEMMs go through at::addmm_out)");
  m.def("half_precision", &half_precision, "whether the forward runs this half-precision dtype natively here",
        py::arg("dtype"));
#ifdef RELBIAS_SOURCE_DIGEST  // an ahead-of-time build (setup.py): the digest of the sources it was built from
#define RELBIAS_STRINGIFY_(x) #x
#define RELBIAS_STRINGIFY(x) RELBIAS_STRINGIFY_(x)
  m.attr("source_digest") = RELBIAS_STRINGIFY(RELBIAS_SOURCE_DIGEST);
#endif
}
