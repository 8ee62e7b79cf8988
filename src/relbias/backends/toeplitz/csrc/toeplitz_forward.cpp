// The toeplitz backend's forward, fused: out and lse of attention with an offset-only bias, one tiled pass with an
// online softmax (FlashAttention-2 forward, Dao 2023, Alg. 1). Same outputs as the PyTorch path of
// relbias.backends.toeplitz._kernel._forward_impl (PyTorch's CPU flash kernel per query block, the bias as a strided
// mask); built and loaded with the backward by relbias.backends.toeplitz._native.
//
// For query i and key j the bias is w[Lq - 1 - i + j] (w: the reversed, scaled per-offset values, (Hb, Lq+Lk-1),
// -inf at a causal call's future offsets), so a query row reads a contiguous window of w. Per query tile, with
// running row maxima m, row sums l and the unnormalised output O (the output rows themselves):
//
//   for each key tile the tile can see (causal: up to its last row's diagonal; a window: its band, Band in
//   toeplitz_common.h):
//     S = scale q k^T                                              (GEMM)
//     x = S + w (visible keys only),  m' = max(m, max_j x),  P = exp(x - m'),  a = exp(m - m')   (one fused pass)
//     l = a l + sum_j P,  O = a O + P v                             (row scaling, GEMM; the first tile: O = P v)
//   out = O / l,  lse = m + log l
//
// Keys beyond a row's diagonal (causal) or outside its window get P = 0 exactly without being exponentiated, and their
// values reach no row that cannot see them, even NaN/inf ones (pv_product); terms exp(x - m') below
// e^-87 are dropped (0), as float32 flushes them (they are below 2^-126 of the row's largest term, 1). A key padding
// mask is one more additive row per (b, h), 0 or -inf (x = S + w + pad: a padded key's P is exactly 0), and a key
// tile whose keys are all padded is skipped (no GEMM). A query that sees no key (causal, every key after it, or
// every key padded) gets out 0 and lse -inf. Attention dropout (dropout_p > 0) multiplies P by the counter-based
// mask (toeplitz_common.h, DropoutMask) after l is summed and before P v: l and lse are the undropped ones
// (FlashAttention-2 with dropout, Dao 2023).
//
// Parallel over (batch x head, query tile) tasks, taken from a shared counter by each of torch's threads: one
// (batch x head)'s query tiles after another, each head's heaviest (a causal call's last query tiles) first, so that
// tasks in flight read one head's keys and values from cache and the last tasks are light ones: enough tasks for
// every thread even at B*H = 1, balanced.
// Each task writes only its own output rows, in an order fixed by the tile sizes, so results are bit-identical
// across runs and thread counts (as far as the BLAS is). GEMMs are single-threaded inside a task: sgemm_ / dgemm_
// that libtorch_cpu exports when built with MKL, else at::addmm_out on tile views. Denormals: flushed on every
// worker while it runs (FlushDenormals, toeplitz_common.h).

#include "toeplitz_common.h"
#include "toeplitz_packed.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

using namespace relbias_toeplitz;

// One row's two passes over its visible keys, each reducing into kLanes partial results combined in a fixed order
// (deterministic; vectorised without -ffast-math). Written as `#pragma omp simd reduction` loops inside the task
// loop instead, both passes ran scalar: the whole forward 2-3x slower, measured at 4096 tokens.

// srow[j] += wrow[j] (Padded: + prow[j], the key padding row, 0 or -inf) for j < n; returns the largest (-inf for
// n = 0; NaN if any is: a NaN query stays NaN). Masked: the sum only for jbeg <= j < jend, -inf at every other j (keys
// the row cannot see: their scores, NaN/inf included, are replaced before the maximum), so that exp_sum gives them
// P = 0 without a fill; the caller passes a row's whole tile (n = bk) when it hides fewer keys than a vector holds (a
// decoding chunk's causal tile, a causal row's last keys): full vectors instead of a scalar tail. In GCC vector
// extensions (also Clang's) of the target's register width: as a lane loop like exp_sum's, GCC kept the max scalar
// (unrolled vmaxss). The maximum is exact, so the width does not change the result; the lanes are halved (halve_lanes;
// skipped where the vector loop did not run).
template <bool Padded, bool Masked, typename T>
T add_bias_max(T* __restrict__ srow, const T* __restrict__ wrow, const T* __restrict__ prow, T scale, int64_t n,
               int64_t jbeg = 0, int64_t jend = 0) {
  constexpr int kLanes = kVectorBytes / sizeof(T);
  using Int = typename std::conditional<sizeof(T) == 4, int32_t, int64_t>::type;
  typedef T Vec __attribute__((vector_size(kVectorBytes)));
  typedef Int IVec __attribute__((vector_size(kVectorBytes)));  // lane indices, for Masked
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const Vec hidden = Vec{} + neg_inf;
  IVec lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  Vec part = hidden;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    Vec x, b;
    std::memcpy(&x, srow + j, sizeof(Vec));
    std::memcpy(&b, wrow + j, sizeof(Vec));
    if constexpr (Padded) {
      Vec c;
      std::memcpy(&c, prow + j, sizeof(Vec));
      b += c;
    }
    x = x * scale + b;
    if constexpr (Masked) {
      const IVec key = lane + static_cast<Int>(j);
      x = (key >= static_cast<Int>(jbeg)) & (key < static_cast<Int>(jend)) ? x : hidden;
    }
    std::memcpy(srow + j, &x, sizeof(Vec));
    part = (x > part) | (x != x) ? x : part;
  }
  T mx = neg_inf;
  if (j > 0) {
    T lanes[kLanes];
    std::memcpy(lanes, &part, sizeof(Vec));
    mx = halve_lanes<kLanes / 2>(lanes, [](T a, T x) { return x > a || x != x ? x : a; });
  }
  for (; j < n; ++j) {
    T x = srow[j] * scale + (Padded ? wrow[j] + prow[j] : wrow[j]);
    if constexpr (Masked) x = j >= jbeg && j < jend ? x : neg_inf;
    srow[j] = x;
    mx = x > mx || x != x ? x : mx;
  }
  return mx;
}

// exp(s - m) for s - m <= 0, 0 below e^-87 (branch-free, so that a loop of it vectorises); Coarse: exp_clamped's
// degree-5 polynomial (float only: half-precision probabilities).
template <bool Coarse = false, typename T>
inline T exp_term(T s, T m, T floor) {
  const T x = s - m;
  const T keep = x < floor ? T(0) : T(1);
  const T clamped = x < floor ? floor : x;
  if constexpr (Coarse) {
    return exp_clamped<5>(clamped) * keep;
  } else {
    return exp_clamped(clamped) * keep;
  }
}

// P[j] = exp(srow[j] - m) for j < n, 0 where that is below e^-87, into srow itself (prow nullptr) or, rounded to Out
// (round_to) from exp_clamped's degree-5 polynomial (half precision needs no more), into prow; returns their sum in T (lanes, then
// the tail). 64 bytes of lanes whatever the target's width (AVX2 runs them as two registers): the same order of
// summation on every ISA.
template <typename T, typename Out = T>
T exp_sum(T* __restrict__ srow, T m, int64_t n, Out* __restrict__ prow = nullptr) {
  constexpr bool kInPlace = std::is_same<Out, T>::value;
  constexpr int kLanes = 64 / sizeof(T);
  const T floor = static_cast<T>(kExpFloor);
  T part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    T p[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      p[l] = exp_term<!kInPlace>(srow[j + l], m, floor);
      part[l] += p[l];
    }
    if constexpr (kInPlace) {
      std::memcpy(srow + j, p, sizeof(p));
    } else {
      round_to(p, prow + j, kLanes);
    }
  }
  T sum = 0;
  if (j > 0) {  // the lanes hold something (log2(kLanes) levels against as many additions in a chain)
    sum = halve_lanes<kLanes / 2>(part, [](T a, T x) { return a + x; });
  }
  for (; j < n; ++j) {
    T p = exp_term<!kInPlace>(srow[j], m, floor);
    sum += p;
    if constexpr (kInPlace) {
      srow[j] = p;
    } else {
      round_to(&p, prow + j, 1);
    }
  }
  return sum;
}

// Whether rows [r0, r1) of a value block (rows ld apart, Dv entries each) hold no NaN/inf: an exponent of all ones,
// read as bits (an integer OR reduction, which vectorises without -ffast-math), the lanes reduced once at the end.
template <typename T>
bool rows_finite(const T* v, int64_t ld, int64_t r0, int64_t r1, int64_t Dv) {
  using Bits = typename std::conditional<sizeof(T) == 2, uint16_t,
                                         typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type>::type;
  constexpr int kLanes = kVectorBytes / sizeof(T);
  typedef Bits Vec __attribute__((vector_size(kVectorBytes)));
  typedef decltype(Vec{} == Vec{}) Mask;  // the signed lanes of a vector comparison
  const Bits exponent = std::is_same<T, at::BFloat16>::value ? Bits(0x7F80u)
                        : std::is_same<T, at::Half>::value   ? Bits(0x7C00u)
                        : sizeof(T) == 4                     ? Bits(0x7F800000u)
                                                             : Bits(0x7FF0000000000000ull);
  const Vec exponents = Vec{} + exponent;
  Mask bad = {};
  bool any = false;
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = v + r * ld;
    int64_t d = 0;
    for (; d + kLanes <= Dv; d += kLanes) {
      Vec x;
      std::memcpy(&x, row + d, sizeof(Vec));
      bad |= (x & exponents) == exponents;
    }
    for (; d < Dv; ++d) {
      Bits x;
      std::memcpy(&x, row + d, sizeof(T));
      any |= (x & exponent) == exponent;
    }
  }
  for (int l = 0; l < kLanes; ++l) any |= bad[l] != 0;
  return !any;
}

// A task's band: Band's rows, none of them seeing a key before first (the task's first key: the packed path starts
// its key tiles on 64-key blocks, and keys before first, padded ones included, are hidden as the band hides others).
struct TaskBand {
  const Band& band;
  int64_t first;
  void row(int64_t t, int64_t lk, int64_t k0, int64_t bk, int64_t& jbeg, int64_t& jend) const {
    band.row(t, lk, k0, bk, jbeg, jend);
    jbeg = std::max(jbeg, std::min(bk, first - k0));
    jend = std::max(jend, jbeg);
  }
};

// O += P v for a key tile of bk keys from key k0 (P: the tile's rows, tile_k apart, 0 at the keys a row cannot
// see; vt: the tile's first value row). One GEMM, unless a value that some row cannot see holds NaN/inf, which the
// GEMM would carry to that row (0 * NaN): then one GEMM per row over the keys it sees, so a NaN/inf reaches exactly
// the rows that see it, as without the band. The keys hidden from some row of the tile are those before the last
// row's first key or from the first row's end on (both ends move forward with the row); checking them reads
// O(bk Dv) values against the GEMM's O(bq bk Dv) work, and none at all in a tile every row sees whole.
template <typename In, typename T>
void pv_product(const TaskBand& band, int64_t i0, int64_t i1, int64_t Lk, int64_t k0, int64_t bk, const In* P,
                int64_t tile_k, const In* vt, int64_t v_ld, int64_t Dv, T beta, T* ob, int64_t ob_ld, bool blas,
                const PackedKV<In>* packed = nullptr, int64_t bh = 0) {
  const int64_t bq = i1 - i0;
  int64_t first_beg, first_end, last_beg, last_end;
  band.row(i0, Lk, k0, bk, first_beg, first_end);
  band.row(i1 - 1, Lk, k0, bk, last_beg, last_end);
  // the packed product of an odd tile also reads the next key (P 0 there), which the tile's rows do not see
  const int64_t read = packed != nullptr && bk % 2 == 1 && k0 + bk < Lk ? bk + 1 : bk;
  const bool finite = first_end <= last_beg ? rows_finite(vt, v_ld, 0, read, Dv)
                                            : rows_finite(vt, v_ld, 0, last_beg, Dv) &&
                                                  rows_finite(vt, v_ld, first_end, read, Dv);
  if (finite) {
    if constexpr (is_half<In>()) {
      if (packed != nullptr) {  // P is 0 at the pad key of an odd tile
        packed_pv(*packed, bh, k0, round_up(bk, 2), bq, P, tile_k, beta != T(0), ob, ob_ld);
        return;
      }
    }
    gemm<In, T>(false, false, bq, Dv, bk, T(1), P, tile_k, vt, v_ld, beta, ob, ob_ld, blas);
    return;
  }
  for (int64_t a = 0; a < bq; ++a) {
    int64_t jbeg, jend;
    band.row(i0 + a, Lk, k0, bk, jbeg, jend);
    gemm<In, T>(false, false, 1, Dv, jend - jbeg, T(1), P + a * tile_k + jbeg, tile_k, vt + jbeg * v_ld, v_ld, beta,
            ob + a * ob_ld, ob_ld, blas);
  }
}

// In: the element type of q, k, v and out (float, double, bfloat16, float16); T = acc_t<In>: of w, the key padding,
// lse, the scores and the softmax statistics. For a half-precision In, P is rounded to In for the P v GEMM (as ATen's
// CPU flash attention does) and O accumulates in a float32 tile, written to out once normalised.
template <typename In>
void forward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w,
                    const c10::optional<at::Tensor>& kpad, const DropoutMask& dropout, double scale_d,
                    const Band& band, int64_t tile_q, int64_t tile_k, bool blas, bool packed_gemms,
                    at::Tensor& out, at::Tensor& lse) {
  using T = acc_t<In>;
  constexpr bool kHalf = is_half<In>();
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Dk = q.size(3);
  const int64_t Lk = k.size(2), Dv = v.size(3);
  const int64_t Hb = w.size(0), w_ld = w.stride(0);
  const int64_t BH = B * H;
  const int64_t n_tiles = (Lq + tile_q - 1) / tile_q;
  const int64_t n_tasks = BH * n_tiles;
  const T scale = static_cast<T>(scale_d);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const T keep_scale = static_cast<T>(dropout.keep_scale);
  constexpr int64_t kWholeSlack = 64 / sizeof(T);  // hidden keys a row may run through (exp_sum's lanes)

  const Rows<In> q_rows(q), k_rows(k), v_rows(v);
  const KeyPadding<T> pad_rows(kpad, H);
  const int64_t q_ld = q_rows.ld, k_ld = k_rows.ld, v_ld = v_rows.ld;
  const T* w_p = w.data_ptr<T>();
  In* o_p = out.data_ptr<In>();
  T* lse_p = lse.data_ptr<T>();
  // packed_gemms (half precision on AMX, toeplitz_packed.h): K and V packed once; key tiles then start on 64-key
  // blocks (the keys before a tile's first visible one are hidden like any other), rows ldS apart
  std::unique_ptr<PackedKV<In>> packed;
  if constexpr (kHalf) {
    if (packed_gemms) packed = std::make_unique<PackedKV<In>>(k_rows, v_rows, BH, Lk, Dk, Dv, tile_k);
  }
  const int64_t ldS = packed ? round_up(tile_k, kPackCols) : tile_k;
  const int64_t acc_ld = packed ? packed->nvb * kPackCols : Dv;  // the accumulator's row stride
  const T score_scale = packed ? scale : T(1);  // brgemm has no alpha: the row pass scales

  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const FlushDenormals flush;  // this thread's mode, restored when the worker is done
    const ReleaseTiles release(packed != nullptr);  // the AMX state brgemm configured, released when the worker is done
    Aligned<T> s_buf(tile_q * ldS);  // scores, then P
    std::vector<T> m_buf(tile_q), l_buf(tile_q);
    T* S = s_buf.data();
    // half precision: P rounded to In, and the output tile's float32 accumulator (else P is S and O is out's rows)
    Aligned<In> p_buf(kHalf ? tile_q * ldS : 0);
    Aligned<T> acc_buf(kHalf ? tile_q * acc_ld : 0);
    T* row_m = m_buf.data();
    T* row_l = l_buf.data();
    for (int64_t task = next.fetch_add(1); task < n_tasks; task = next.fetch_add(1)) {
      const int64_t bh = task / n_tiles;
      const int64_t qt = n_tiles - 1 - task % n_tiles;  // a head's last query tiles first: a causal call's heaviest
      const int64_t i0 = qt * tile_q, i1 = std::min(Lq, i0 + tile_q), bq = i1 - i0;
      const int64_t hb = Hb == 1 ? 0 : bh % H;
      const T* wr = w_p + hb * w_ld;
      const In* qb = q_rows(bh) + i0 * q_ld;
      const In* kb = k_rows(bh);
      const In* vb = v_rows(bh);
      const T* pad = pad_rows(bh);  // nullptr without a key padding mask
      In* ob = o_p + (bh * Lq + i0) * Dv;  // the tile's output rows
      T* acc;  // O, unnormalised until the end: out's rows themselves, or a float32 tile for a half-precision In
      const In* P;  // P as the P v GEMM reads it
      if constexpr (kHalf) {
        acc = acc_buf.data();
        P = p_buf.data();
      } else {
        acc = ob;
        P = S;
      }
      T* lb = lse_p + bh * Lq + i0;
      std::fill(row_m, row_m + bq, neg_inf);
      std::fill(row_l, row_l + bq, T(0));
      int64_t kbeg = band.begin(i0, Lk), kend = band.end(i1 - 1, Lk);  // the keys some row of the tile sees
      if (pad != nullptr) {  // only the kept keys' range; the row itself only where padding lies inside it
        const PadRange range = pad_range(pad, Lk);
        kbeg = std::max(kbeg, range.first);
        kend = std::min(kend, range.last);
        if (!range.interior) pad = nullptr;
      }
      const TaskBand task_band{band, kbeg};  // (packed: kbeg's block starts the tiles; the keys before it hidden)
      if (packed) kbeg -= kbeg % kPackCols;
      bool fresh = true;  // O holds nothing yet: the first P v product writes it (beta 0), unscaled
      for (int64_t k0 = kbeg; k0 < kend; k0 += tile_k) {
        const int64_t k1 = std::min(kend, k0 + tile_k), bk = k1 - k0;
        if (pad != nullptr && all_padded(pad + k0, bk)) continue;  // no query sees these keys
        if (packed) {  // unscaled: the row pass scales
          if constexpr (kHalf) {
            packed_scores(*packed, bh, k0, round_up(bk, kPackCols), bq, qb, q_ld, S, ldS);
          }
        } else {
          gemm<In, T>(false, true, bq, bk, Dk, scale, qb, q_ld, kb + k0 * k_ld, k_ld, T(0), S, ldS, blas);
        }
        for (int64_t a = 0; a < bq; ++a) {
          const int64_t i = i0 + a;
          T* __restrict__ srow = S + a * ldS;
          int64_t jbeg, jend;  // keys k0 + j, jbeg <= j < jend, are visible to query i
          task_band.row(i, Lk, k0, bk, jbeg, jend);
          const int64_t n = jend - jbeg;
          T* __restrict__ seen = srow + jbeg;
          const T* __restrict__ wrow = wr + (Lq - 1 - i + k0);  // the bias of key k0 for query i
          const T* __restrict__ prow = pad == nullptr ? nullptr : pad + k0;
          // a row that hides some keys, fewer than one 64-byte vector holds, runs its whole tile in vectors (hidden
          // keys -inf), else its visible keys only (no work for the keys it cannot see)
          const bool whole = n > 0 && n < bk && bk - n < kWholeSlack;
          const T sc = score_scale;
          const T mx = whole ? (pad == nullptr ? add_bias_max<false, true>(srow, wrow, prow, sc, bk, jbeg, jend)
                                               : add_bias_max<true, true>(srow, wrow, prow, sc, bk, jbeg, jend))
                             : (pad == nullptr ? add_bias_max<false, false>(seen, wrow + jbeg, prow, sc, n)
                                               : add_bias_max<true, false>(seen, wrow + jbeg, prow + jbeg, sc, n));
          const T m_old = row_m[a];
          const T m_new = mx > m_old || mx != mx ? mx : m_old;  // NaN stays
          if (n == 0 || m_new == neg_inf) {  // nothing visible (yet): P = 0, O and l unchanged
            std::fill(srow, srow + bk, T(0));
            if constexpr (kHalf) {
              In* const ph = p_buf.data() + a * ldS;
              std::fill(ph, ph + (packed ? round_up(bk, 2) : bk), In(0));
            }
            continue;
          }
          // half precision without dropout: P straight into its rounded row; else into S (dropout is applied to the
          // float32 P, which is then rounded)
          In* const prow_h = kHalf && !dropout.on ? p_buf.data() + a * ldS : nullptr;
          T sum;
          if (prow_h != nullptr) {
            if constexpr (kHalf) {
              if (whole) {
                sum = exp_sum(srow, m_new, bk, prow_h);  // P = 0 at the hidden keys (-inf)
              } else {
                sum = exp_sum(seen, m_new, n, prow_h + jbeg);
                std::fill(prow_h, prow_h + jbeg, In(0));
                std::fill(prow_h + jend, prow_h + bk, In(0));
              }
            }
          } else if (whole) {
            sum = exp_sum(srow, m_new, bk);  // P = 0 at the hidden keys (-inf)
          } else {
            sum = exp_sum(seen, m_new, n);
            std::fill(srow, seen, T(0));
            std::fill(srow + jend, srow + bk, T(0));
          }
          // 0 while m_old is -inf (O and l are still 0; std::exp's own value, without the call)
          const T alpha = m_old == neg_inf ? T(0) : std::exp(m_old - m_new);
          row_l[a] = alpha * row_l[a] + sum;
          row_m[a] = m_new;
          if (dropout.on) {
            apply_dropout(seen, n, dropout.row(bh, i), dropout.key_base(k0 + jbeg), dropout.threshold, keep_scale);
          }
          if constexpr (kHalf) {
            In* const ph = p_buf.data() + a * ldS;
            if (prow_h == nullptr) round_to(srow, ph, bk);
            if (packed && bk % 2 == 1) ph[bk] = In(0);  // the packed P v product's pad key
          }
          if (!fresh && alpha != T(1)) {
            T* __restrict__ orow = acc + a * acc_ld;
            for (int64_t d = 0; d < Dv; ++d) orow[d] *= alpha;
          }
        }
        pv_product(task_band, i0, i1, Lk, k0, bk, P, ldS, vb + k0 * v_ld, v_ld, Dv, fresh ? T(0) : T(1), acc, acc_ld,
                   blas, packed.get(), bh);
        fresh = false;
      }
      for (int64_t a = 0; a < bq; ++a) {
        T* __restrict__ orow = acc + a * acc_ld;
        const T l = row_l[a];
        if (l == T(0)) {  // sees no key (causal or padded): out 0, lse -inf (a NaN score stays NaN)
          std::fill(ob + a * Dv, ob + (a + 1) * Dv, In(0));
          lb[a] = neg_inf;
          continue;
        }
        const T inv = T(1) / l;  // one division per row: a vector division per element cost as much as a GEMM
        for (int64_t d = 0; d < Dv; ++d) orow[d] *= inv;
        if constexpr (kHalf) round_to(orow, ob + a * Dv, Dv);
        lb[a] = row_m[a] + std::log(l);
      }
    }
  });
}

}  // namespace

// (out, lse) of the toeplitz attention; see the file's head. Shapes: q (B, H, Lq, Dk); k (B, H, Lk, Dk); v
// (B, H, Lk, Dv); w (Hb, Lq + Lk - 1) with Hb 1 or H, the reversed scaled bias (-inf at a causal call's future
// offsets); CPU tensors of one dtype, float32 or float64, q, k, v with unit stride along D (any other strides: read
// in place), w with unit stride along offsets (any row stride: a view into a longer table). delta: key s is visible
// to query t when s <= t + delta (causal); window_left, window_right: and t + delta - window_left <= s <= t + delta +
// window_right (-1: no bound on that side; Band in toeplitz_common.h). tile_q, tile_k: query rows and keys per tile. Returns out (B, H, Lq, Dv) and lse
// (B, H, Lq), contiguous, in that dtype. blas: call the exported BLAS directly (when present) instead of
// at::addmm_out. kpad: None or the key padding mask as an additive (1 or B, 1 or H, Lk) row, 0 or -inf, contiguous.
// dropout_p in [0, 1): attention dropout with the counter-based mask of seed, the first query's and the first key's
// absolute positions (0: none).
std::vector<at::Tensor> toeplitz_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& w, double scale, int64_t delta, bool is_causal,
                                         int64_t tile_q, int64_t tile_k, bool blas,
                                         const c10::optional<at::Tensor>& kpad, double dropout_p, int64_t seed,
                                         int64_t query_start, int64_t key_start, int64_t window_left,
                                         int64_t window_right) {
  const auto dtype = check_qkvw(q, k, v, w, "toeplitz_forward", Layout::kUnitLast, /*half_ok=*/true);
  const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
  TORCH_CHECK(!half || have_blas(dtype), "toeplitz_forward: ", dtype, " inputs need the half-precision GEMM that "
              "this libtorch does not export (MKL's cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32)");
  TORCH_CHECK(window_left >= -1 && window_right >= -1, "toeplitz_forward: window sides must be >= 0, or -1 (none)");
  const Band band(delta, is_causal, window_left, window_right);
  check_kpad(kpad, q, k, acc_dtype(dtype), "toeplitz_forward");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "toeplitz_forward: dropout_p must be in [0, 1)");
  const DropoutMask dropout(dropout_p, seed, query_start, key_start, q.size(1));
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  TORCH_CHECK(tile_q > 0 && tile_k > 0, "toeplitz_forward: tiles must be positive");
  tile_q = std::min(tile_q, std::max<int64_t>(Lq, 1));  // no larger buffers than the lengths need (decoding: 1 row)
  tile_k = std::min(tile_k, std::max<int64_t>(Lk, 1));
  const int64_t big = std::numeric_limits<int>::max();
  // BLAS takes int leading dimensions (a length-1 dimension's stride is never read: Rows)
  const auto rows_fit = [&](const at::Tensor& t) { return t.size(2) <= 1 || t.stride(2) < big; };
  const bool fits_int = q.size(3) < big && v.size(3) < big && tile_k < big && rows_fit(q) && rows_fit(k) && rows_fit(v);
  TORCH_CHECK(!half || fits_int, "toeplitz_forward: ", dtype, " inputs need head dims and row strides below 2^31");
  blas = blas && have_blas(dtype) && fits_int;
  at::Tensor out = at::empty({B, H, Lq, v.size(3)}, q.options());
  at::Tensor lse = at::empty({B, H, Lq}, q.options().dtype(acc_dtype(dtype)));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  // half precision on the CPU's matrix units with enough query rows to repay packing K and V (a decoding step's
  // few rows run MKL's GEMM on them as they are): brgemm on packed operands (toeplitz_packed.h)
  const bool packed = half && Lq >= kPackCols && q.size(3) > 0 && q.size(3) % 2 == 0 &&
                       (tile_k % kPackCols == 0 || tile_k >= Lk) &&
                      packed_units(dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "toeplitz_forward", [&] {
    forward_kernel<scalar_t>(q, k, v, w, kpad, dropout, scale, band, tile_q, tile_k, blas, packed, out, lse);
  });
  return {out, lse};
}
