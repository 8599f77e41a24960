// Causal (bottom-right aligned) and sequence-end masking, and which key blocks a query block visits.
// Query row i sees key j iff j < seqlen_k and (not causal or j <= i + seqlen_k - seqlen_q).
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "fa2/utils.h"

namespace fa2 {
using namespace cute;

// Number of key blocks query block m_block visits: blocks [0, n_block_end). Blocks entirely above the
// causal diagonal are never loaded. <= 0 means no row of the block sees any key.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int key_block_end(int m_block, int seqlen_q, int seqlen_k, bool causal) {
  int end = ceil_div(seqlen_k, kBlockN);
  if (causal) {
    // Last key the block's last row sees, plus one.
    const int last_key_end = (m_block + 1) * kBlockM + seqlen_k - seqlen_q;
    end = min(end, last_key_end <= 0 ? 0 : ceil_div(last_key_end, kBlockN));
  }
  return end;
}

// Key blocks (counted from the last visited one downwards) that may hold a masked element: the
// partial block at seqlen_k, and for causal every block the diagonal crosses.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ constexpr int masked_key_blocks(bool causal) {
  return causal ? ceil_div(kBlockM, kBlockN) + 1 : 1;
}

// Set masked scores to -inf. `coord` is the MMA partition of an identity tensor over the score tile,
// so coord(i) is the (row, col) within the tile of acc_s(i).
template <typename TensorS, typename CoordS>
__device__ __forceinline__ void apply_mask(TensorS& acc_s, CoordS const& coord, int row_offset, int col_offset,
                                           int seqlen_q, int seqlen_k, bool causal) {
  Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
  Tensor c = make_tensor(coord.data(), rowcol_layout(coord.layout()));
  const int diagonal = seqlen_k - seqlen_q;
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    const int row = row_offset + get<0>(c(mi, 0));
    const int col_end = causal ? min(seqlen_k, row + diagonal + 1) : seqlen_k;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) {
      if (col_offset + get<1>(c(0, ni)) >= col_end) s(mi, ni) = -INFINITY;
    }
  }
}

}  // namespace fa2
