// Attention dropout: which probabilities are kept, drawn from a counter-based generator (Philox4x32) so that the
// forward and the backward draw the same bits for a score without storing a mask. The mapping is
// fa2.reference.dropout_keep_mask's. Eight scores share one Philox block: rows i and i ^ 8 times columns j, j ^ 1,
// j ^ 32 and j ^ 33, which one thread holds in every MMA tiling here (an m16n8 accumulator, and a 64 x N wgmma one
// alike, gives a thread rows r and r + 8 and columns c and c + 1; the forwards' warps span the whole key block, the
// backward's S/dP warps own one 8-column atom in every 32), so each thread runs one Philox per eight of its scores
// (sm90/dropout.h: per four in d256's 80-key blocks, which split some groups of 64). Each score takes 16 bits:
// output 2 * bit 5 of j + bit 3 of i, half bit 0 of j; kept iff below floor((1 - dropout_p) * 2^16).
#pragma once

#include <cstdint>
#include <cute/tensor.hpp>

#include "common/params.h"

namespace fa2 {
using namespace cute;

// Philox4x32 with 7 rounds, flash-attn's count (Random123's fewest that pass BigCrush).
__device__ __forceinline__ uint4 philox4x32_7(uint4 c, uint2 k) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  CUTE_UNROLL
  for (int r = 0; r < 7; ++r) {
    if (r > 0) k.x += kW0, k.y += kW1;
    const uint32_t hi0 = __umulhi(kM0, c.x), lo0 = kM0 * c.x;
    const uint32_t hi1 = __umulhi(kM1, c.z), lo1 = kM1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// Not inlined, for the backward: its kernels then keep their registers with dropout off, at some cost with it on
// (docs/tuning.md#dropout). The forward has an instance without dropout and inlines the draw.
static __device__ __noinline__ uint4 philox4x32_7_call(uint4 c, uint2 k) { return philox4x32_7(c, k); }

// One (batch, head)'s draw: the key and the counter words that do not depend on the score.
struct DropoutDraw {
  uint2 key;
  uint32_t bh, offset;
  uint32_t threshold_high;  // floor((1 - dropout_p) * 2^16) << 16 (dropout_p > 0, so it fits)

  // Reads rng_state only where dropout is on (nullptr: off).
  __device__ __forceinline__ DropoutDraw(const int64_t* rng_state, uint32_t threshold, int nheads, int batch,
                                         int head) {
    const bool on = rng_state != nullptr;
    const uint64_t seed = on ? static_cast<uint64_t>(rng_state[0]) : 0;
    key = make_uint2(uint32_t(seed), uint32_t(seed >> 32));
    offset = on ? uint32_t(static_cast<uint64_t>(rng_state[1])) : 0u;
    threshold_high = threshold << 16;
    set_head(nheads, batch, head);
  }
  __device__ __forceinline__ DropoutDraw(FwdParams const& p, int batch, int head)
      : DropoutDraw(p.rng_state, p.dropout_threshold, p.nheads, batch, head) {}

  // Another (batch, head) of the same call (a persistent kernel's next tile): only the counter's third word moves.
  __device__ __forceinline__ void set_head(int nheads, int batch, int head) {
    bh = uint32_t(batch) * uint32_t(nheads) + uint32_t(head);
  }

  // The Philox block of the eight scores around (row, col).
  template <bool kInline>
  __device__ __forceinline__ uint4 block(int row, int col) const {
    const uint4 counter = make_uint4(uint32_t(col) & ~33u, uint32_t(row) & ~8u, bh, offset);
    return kInline ? philox4x32_7(counter, key) : philox4x32_7_call(counter, key);
  }

  // Whether the score taking half `hi` (bit 0 of its column) of output word `bits` is kept. Both halves are compared
  // in the high half, where the high one already is: one compare for it, a shift and a compare for the low one, in
  // place of extracting each (the forward's dropout is bound by such integer work, docs/tuning.md#dropout).
  __device__ __forceinline__ bool kept(uint32_t bits, int hi) const {
    return (hi ? bits : bits << 16) < threshold_high;
  }
};

}  // namespace fa2
