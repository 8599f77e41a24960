// Dropout on a consumer warpgroup's S accumulator: the probabilities common/philox.h's draw drops are zeroed, the same
// (batch, head, row, key) elements as the mma.sync family drops (sm80/dropout.h), so that its backward, which draws
// the mask again, sees this forward's. Kept ones are scaled by 1 / (1 - p) once, in the output (softmax.h: finalize);
// l and lse sum the probabilities before dropout, as fa2.reference.attention_ref does.
//
// A 64 x N wgmma accumulator gives a thread rows r and r + 8 (r = 16 w + l / 4 in its warpgroup's 64: bit 3 clear)
// and, in each 8-key atom j, keys c + 8 j and c + 8 j + 1 (c = 2 (l % 4)): m16n8's pattern. A Philox block's eight
// scores (rows i, i ^ 8 times keys j, j ^ 1, j ^ 32, j ^ 33) are then one thread's wherever the key block holds both
// atoms 32 keys apart: key blocks of a multiple of 64 keys (d64, d128: 128) draw once per eight scores; d256's 80-key
// blocks, which start at 0, 16, 32 or 48 (mod 64), draw once per atom and take the half of the block their keys
// name (once per four scores, against twice the tensor-core work per score).         docs/tuning.md#sm90-dropout
#pragma once

#include <cute/tensor.hpp>

#include "common/philox.h"

namespace fa2::sm90 {
using namespace cute;

// s: (rows, columns) of the accumulator (utils.h: rowcol), column 2 j + h being atom j's key c + 8 j + h; cS_rc its
// coordinates in the (kBlockM, kBlockN) tile; first_row and key0 the tile's first query row and key.
template <int kBlockN, class TensorS, class TensorC>
__device__ __forceinline__ void apply_dropout(TensorS& s, TensorC const& cS_rc, DropoutDraw const& draw, int first_row,
                                              int key0) {
  static_assert(decltype(size<0>(s))::value == 2 && decltype(size<1>(s))::value == kBlockN / 4);
  constexpr int kAtoms = kBlockN / 8;
  const int row = first_row + get<0>(cS_rc(0, 0));  // and row + 8 at s(1, _)
  // Words x, y of a block hold rows i, i + 8 of its keys with bit 5 clear, z, w those with bit 5 set; in each word the
  // low half is the even key's, the high half the odd key's.
  auto drop = [&](int j, uint32_t bits_r, uint32_t bits_r8) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      if (!draw.kept(bits_r, h)) s(0, 2 * j + h) = 0.f;
      if (!draw.kept(bits_r8, h)) s(1, 2 * j + h) = 0.f;
    }
  };
  if constexpr (kBlockN % 64 == 0) {
    // Atoms j and j + 4 of each 64-key group: keys k and k + 32, bit 5 of k clear.
    CUTE_UNROLL
    for (int j = 0; j < kAtoms; ++j) {
      if ((j / 4) % 2 != 0) continue;
      const uint4 r = draw.template block<true>(row, key0 + get<1>(cS_rc(0, 2 * j)));
      drop(j, r.x, r.y);
      drop(j + 4, r.z, r.w);
    }
  } else {
    CUTE_UNROLL
    for (int j = 0; j < kAtoms; ++j) {
      const int key = key0 + get<1>(cS_rc(0, 2 * j));
      const uint4 r = draw.template block<true>(row, key);
      const bool high = (key & 32) != 0;  // uniform over the warp: a thread's keys in an atom differ in bits 0-2
      drop(j, high ? r.z : r.x, high ? r.w : r.y);
    }
  }
}

}  // namespace fa2::sm90
