// The half-precision forward's GEMMs on the CPU's matrix units (AMX) through ATen's cpublas::brgemm (oneDNN's
// batch-reduce GEMM ukernel), as ATen's own CPU flash attention drives them: the right-hand operands, kᵀ for the
// scores and v for P v, packed once per call into VNNI pairs (two consecutive rows of the operand interleaved per
// 32-bit word: the layout brgemm reads), so that every (query tile, key tile) product reads them as they are; the
// query rows and P are read in place. kᵀ is packed in blocks as wide as a key tile, so that a tile's scores are one
// brgemm call (ld_b the block's width; 64-column calls, eight per 512-key tile, ran the bfloat16 forward about 10%
// slower). Packing costs one pass over K and V, O(N D) memory (their size again, the keys rounded up to whole key
// blocks: at most one key tile more per batch x head), against GEMMs that would otherwise pack per call.
#pragma once

#include "toeplitz_common.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
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
//   keys:   per bh, blocks of kb keys (kb: the key tile rounded up to 64), each (D / 2, kb, 2): entry (d, j) of kᵀ,
//           key kb c + j, at ((d / 2) * kb + j) * 2 + d % 2 (keys past Lk: 0);
//   values: per bh, nvb blocks of 64 value columns, each (nkb * 32, 64, 2): entry (j, e) of v, column 64 c + e, at
//           ((j / 2) * 64 + e) * 2 + j % 2 (keys past Lk, columns past Dv: 0).
// D must be even (a pair per word). A key tile from key k0 (a multiple of 64) reads its scores' operand from one key
// block or, straddling two, from both (packed_scores), and values(bh, c) + k0 * 64.
template <typename In>
struct PackedKV {
  int64_t D = 0, Dv = 0, nkb = 0, nvb = 0;
  int64_t kb = 0, keys_per_bh = 0;  // keys per key block (a multiple of 64); the key blocks' keys per bh
  std::unique_ptr<In[]> keys_, values_;  // uninitialised: packing writes every entry

  // tile_k: keys per key tile (the key blocks' width, rounded up to 64 and at most the padded keys)
  PackedKV(const Rows<In>& k_rows, const Rows<In>& v_rows, int64_t BH, int64_t Lk, int64_t D_, int64_t Dv_,
           int64_t tile_k)
      : D(D_), Dv(Dv_), nkb((Lk + kPackCols - 1) / kPackCols), nvb((Dv_ + kPackCols - 1) / kPackCols),
        kb(std::min(round_up(tile_k, kPackCols), nkb * kPackCols)), keys_per_bh(round_up(nkb * kPackCols, kb)),
        keys_(new In[BH * keys_per_bh * D_]), values_(new In[BH * nvb * nkb * kPackCols * kPackCols]) {
    static_assert(sizeof(In) == 2, "VNNI pairs of 16-bit elements");
    at::parallel_for(0, BH * nkb, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = task / nkb, c = task % nkb;
        pack_keys(k_rows(bh), k_rows.ld, Lk, c, keys(bh));
        for (int64_t vc = 0; vc < nvb; ++vc) pack_values(v_rows(bh), v_rows.ld, Lk, c, vc, values(bh, vc));
      }
    });
  }

  In* keys(int64_t bh) { return keys_.get() + bh * keys_per_bh * D; }
  const In* keys(int64_t bh) const { return keys_.get() + bh * keys_per_bh * D; }
  In* values(int64_t bh, int64_t vc) { return values_.get() + (bh * nvb + vc) * nkb * kPackCols * kPackCols; }
  const In* values(int64_t bh, int64_t vc) const {
    return values_.get() + (bh * nvb + vc) * nkb * kPackCols * kPackCols;
  }

 private:
  // Keys 64 c .. 64 c + 63 of kᵀ into their key block: word (d / 2) * kb + j of the block holds its key j's elements
  // d, d + 1 (one 32-bit copy; 64 consecutive words per pair of elements).
  void pack_keys(const In* k, int64_t ld, int64_t Lk, int64_t c, In* bh_keys) const {
    const int64_t first = c * kPackCols;
    uint32_t* dst = reinterpret_cast<uint32_t*>(bh_keys + (first / kb) * kb * D) + first % kb;
    for (int64_t dp = 0; dp < D / 2; ++dp) {
      for (int64_t j = 0; j < kPackCols; ++j) {
        uint32_t word = 0;
        if (first + j < Lk) std::memcpy(&word, k + (first + j) * ld + 2 * dp, sizeof(word));
        dst[dp * kb + j] = word;
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

// S (bq x keys, ldS) = q (bq x D, ld q_ld) kᵀ for the keys from key k0 (k0 and keys multiples of 64; float32,
// unscaled): one brgemm call per key block the tile reaches into (one for a tile on a block's start).
template <typename In>
inline void packed_scores(const PackedKV<In>& packed, int64_t bh, int64_t k0, int64_t keys, int64_t bq, const In* q,
                          int64_t q_ld, float* S, int64_t ldS) {
  const int64_t kb = packed.kb;
  for (int64_t done = 0; done < keys;) {
    const int64_t key = k0 + done, column = key % kb, n = std::min(keys - done, kb - column);
    const In* block = packed.keys(bh) + (key / kb) * kb * packed.D;
    at::native::cpublas::brgemm(bq, n, packed.D, q_ld, kb, ldS, false, q, block + 2 * column, S + done, true);
    done += n;
  }
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
