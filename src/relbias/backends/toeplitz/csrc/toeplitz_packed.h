// The half-precision forward's GEMMs on the CPU's matrix units (AMX) through ATen's cpublas::brgemm (oneDNN's
// batch-reduce GEMM ukernel), as ATen's own CPU flash attention drives them: the right-hand operands, kᵀ for the
// scores and v for P v, packed once per call into VNNI pairs (two consecutive rows of the operand interleaved per
// 32-bit word, 64 columns per block: the layout brgemm reads with ld_b 64), so that every (query tile, key tile)
// product reads them as they are; the query rows and P are read in place. Packing costs one pass over K and V, O(N D)
// memory (their size again), against GEMMs that would otherwise pack per call.
#pragma once

#include "toeplitz_common.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <cstring>
#include <memory>

namespace relbias_toeplitz {

constexpr int64_t kPackCols = 64;  // columns per packed block

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Whether brgemm runs dtype on packed operands here: the CPU's matrix units for it as oneDNN sees them
// (cpublas::could_pack: AMX-BF16, AMX-FP16) and ATen's AVX-512 kernels (brgemm's half-precision path packs with
// ATen's vectorised code, which refuses under a lower ATEN_CPU_CAPABILITY).
inline bool packed_units(at::ScalarType dtype) {
  static const bool avx512 = at::get_cpu_capability().rfind("AVX512", 0) == 0;
  return avx512 && at::native::cpublas::could_pack(dtype);
}

// K and V of every (batch, head) row packed for brgemm (In: bfloat16 or float16, 16-bit):
//   keys:   per bh, nkb blocks of 64 keys, each (D / 2, 64, 2): entry (d, j) of kᵀ, key 64 c + j, at
//           ((d / 2) * 64 + j) * 2 + d % 2 (keys past Lk: 0);
//   values: per bh, nvb blocks of 64 value columns, each (nkb * 32, 64, 2): entry (j, e) of v, column 64 c + e, at
//           ((j / 2) * 64 + e) * 2 + j % 2 (keys past Lk, columns past Dv: 0).
// D must be even (a pair per word). A key tile from key k0 (a multiple of 64) reads keys(bh, k0 / 64) and
// values(bh, c) + k0 * 64.
template <typename In>
struct PackedKV {
  int64_t D = 0, Dv = 0, nkb = 0, nvb = 0;
  std::unique_ptr<In[]> keys_, values_;  // uninitialised: packing writes every entry

  PackedKV(const Rows<In>& k_rows, const Rows<In>& v_rows, int64_t BH, int64_t Lk, int64_t D_, int64_t Dv_)
      : D(D_), Dv(Dv_), nkb((Lk + kPackCols - 1) / kPackCols), nvb((Dv_ + kPackCols - 1) / kPackCols),
        keys_(new In[BH * nkb * kPackCols * D_]), values_(new In[BH * nvb * nkb * kPackCols * kPackCols]) {
    static_assert(sizeof(In) == 2, "VNNI pairs of 16-bit elements");
    at::parallel_for(0, BH * nkb, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = task / nkb, c = task % nkb;
        pack_keys(k_rows(bh), k_rows.ld, Lk, c, keys(bh, c));
        for (int64_t vc = 0; vc < nvb; ++vc) pack_values(v_rows(bh), v_rows.ld, Lk, c, vc, values(bh, vc));
      }
    });
  }

  In* keys(int64_t bh, int64_t c) { return keys_.get() + (bh * nkb + c) * kPackCols * D; }
  const In* keys(int64_t bh, int64_t c) const { return keys_.get() + (bh * nkb + c) * kPackCols * D; }
  In* values(int64_t bh, int64_t vc) { return values_.get() + (bh * nvb + vc) * nkb * kPackCols * kPackCols; }
  const In* values(int64_t bh, int64_t vc) const {
    return values_.get() + (bh * nvb + vc) * nkb * kPackCols * kPackCols;
  }

 private:
  // Block c of kᵀ: word (d / 2) * 64 + j holds key 64 c + j's elements d, d + 1 (one 32-bit copy).
  void pack_keys(const In* k, int64_t ld, int64_t Lk, int64_t c, In* out) const {
    uint32_t* dst = reinterpret_cast<uint32_t*>(out);
    for (int64_t j = 0; j < kPackCols; ++j) {
      const int64_t key = c * kPackCols + j;
      for (int64_t dp = 0; dp < D / 2; ++dp) {
        uint32_t word = 0;
        if (key < Lk) std::memcpy(&word, k + key * ld + 2 * dp, sizeof(word));
        dst[dp * kPackCols + j] = word;
      }
    }
  }

  // Keys 64 c .. 64 c + 63 of value column block vc: word (j / 2) * 64 + e holds keys j, j + 1 of column 64 vc + e.
  void pack_values(const In* v, int64_t ld, int64_t Lk, int64_t c, int64_t vc, In* block) const {
    uint16_t* dst = reinterpret_cast<uint16_t*>(block) + c * kPackCols * kPackCols;
    for (int64_t j = 0; j < kPackCols; ++j) {
      const int64_t key = c * kPackCols + j;
      uint16_t* row = dst + (j / 2) * kPackCols * 2 + (j % 2);
      for (int64_t e = 0; e < kPackCols; ++e) {
        const int64_t col = vc * kPackCols + e;
        uint16_t x = 0;
        if (key < Lk && col < Dv) std::memcpy(&x, v + key * ld + col, sizeof(x));
        row[e * 2] = x;
      }
    }
  }
};

// Releases the matrix units' state that brgemm configured on this thread (ATen's cpublas::brgemm_release) when it
// goes out of scope, where on is true.
class ReleaseTiles {
 public:
  explicit ReleaseTiles(bool on) : on_(on) {}
  ~ReleaseTiles() {
    if (on_) at::native::cpublas::brgemm_release();
  }
  ReleaseTiles(const ReleaseTiles&) = delete;
  ReleaseTiles& operator=(const ReleaseTiles&) = delete;

 private:
  bool on_;
};

// S (bq x nb * 64, ldS) = q (bq x D, ld q_ld) kᵀ over the nb packed key blocks from block c0 (float32, unscaled).
template <typename In>
inline void packed_scores(const PackedKV<In>& packed, int64_t bh, int64_t c0, int64_t nb, int64_t bq, const In* q,
                          int64_t q_ld, float* S, int64_t ldS) {
  for (int64_t b = 0; b < nb; ++b)
    at::native::cpublas::brgemm(bq, kPackCols, packed.D, q_ld, kPackCols, ldS, false, q, packed.keys(bh, c0 + b),
                                S + b * kPackCols, true);
}

// acc (bq x nvb * 64, ld_acc) (+)= P (bq x keys, ld ldP; keys even, P 0 past the tile's own) v over the keys from
// key k0 (a multiple of 64).
template <typename In>
inline void packed_pv(const PackedKV<In>& packed, int64_t bh, int64_t k0, int64_t keys, int64_t bq, const In* P,
                      int64_t ldP, bool add, float* acc, int64_t ld_acc) {
  for (int64_t vc = 0; vc < packed.nvb; ++vc)
    at::native::cpublas::brgemm(bq, kPackCols, keys, ldP, kPackCols, ld_acc, add, P,
                                packed.values(bh, vc) + k0 * kPackCols, acc + vc * kPackCols, true);
}

}  // namespace relbias_toeplitz
