// The visible band of keys, as arithmetic on positions: which key blocks a query block visits, which query blocks a
// key block is seen by, which rows of a tile need no mask; and the scalar pieces of softcap and ALiBi. Query row i sees
// key j iff j < seqlen_k and i + diagonal - left <= j <= i + diagonal + right, with diagonal = seqlen_k - seqlen_q and
// left/right = window_left/window_right, -1 for an unbounded side (causal: right = 0). No fragment layouts here: each
// family applies the band to its own accumulators (sm80/mask.h).
#pragma once

#include <climits>
#include <cmath>
#include <cute/tensor.hpp>

#include "common/params.h"

namespace fa2 {
using namespace cute;

// The key blocks [begin, end) that a query block's rows can see, and those of them that may need a mask:
// blocks below left_masked_end are crossed by the band's left edge, blocks from right_masked_begin on by
// its right edge or by seqlen_k. Blocks outside [begin, end) are never loaded. end <= begin: no row of the
// block sees any key.
struct KeyBlocks {
  int begin, end, left_masked_end, right_masked_begin;
};

template <int kBlockM, int kBlockN>
__device__ __forceinline__ KeyBlocks key_blocks(FwdParams const& p, int m_block, int seqlen_q, int seqlen_k) {
  const int diagonal = seqlen_k - seqlen_q;
  const int first_row = m_block * kBlockM, last_row = first_row + kBlockM - 1;
  KeyBlocks b;
  b.end = ceil_div(seqlen_k, kBlockN);
  b.right_masked_begin = b.end - 1;
  if (p.window_right >= 0) {
    const int last_key_end = last_row + diagonal + p.window_right + 1;  // last row's last visible key, plus one
    b.end = min(b.end, last_key_end <= 0 ? 0 : ceil_div(last_key_end, kBlockN));
    // Blocks past the first row's last visible key hold a masked element.
    b.right_masked_begin = min(b.end - 1, max(first_row + diagonal + p.window_right + 1, 0) / kBlockN);
  }
  b.begin = 0, b.left_masked_end = 0;
  if (p.window_left >= 0) {
    b.begin = max(first_row + diagonal - p.window_left, 0) / kBlockN;  // first row's first visible key
    // Blocks before the last row's first visible key hold a masked element.
    b.left_masked_end = ceil_div(max(last_row + diagonal - p.window_left, 0), kBlockN);
  }
  return b;
}

// Split-KV: split `split` of `splits` takes an equal run of the visited key blocks (the last run may be shorter or
// empty); the mask bounds stay the query block's.
__device__ __forceinline__ KeyBlocks split_share(KeyBlocks b, int split, int splits) {
  const int per = ceil_div(max(b.end - b.begin, 0), splits);
  b.begin = min(b.begin + split * per, b.end);
  b.end = min(b.begin + per, b.end);
  return b;
}

// The query blocks [begin, end) that see at least one key of key block n_block.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int2 query_blocks(FwdParams const& p, int n_block, int seqlen_q, int seqlen_k) {
  const int diagonal = seqlen_k - seqlen_q;
  const int first_key = n_block * kBlockN, last_key = first_key + kBlockN - 1;
  int begin = 0, end = ceil_div(seqlen_q, kBlockM);
  // Row i sees key j only if j <= i + diagonal + right, i.e. i >= j - diagonal - right.
  if (p.window_right >= 0) begin = max(first_key - diagonal - p.window_right, 0) / kBlockM;
  // ... and only if j >= i + diagonal - left, i.e. i <= j - diagonal + left.
  if (p.window_left >= 0) {
    const int last_row = last_key - diagonal + p.window_left;
    end = min(end, last_row < 0 ? 0 : last_row / kBlockM + 1);
  }
  return make_int2(begin, end);
}

// The row offsets at which a (rows, cols) tile at col_offset holds no element outside the band or past seqlen_k. The
// backward's kernel computes them once per key block, so its loop over query tiles tests two bounds per tile instead
// of redoing the window arithmetic (the window fields' loads and a chain of five branches in every plain tile's path).
struct UnmaskedRows {
  int lo, hi;  // no mask for lo <= row_offset <= hi; empty (lo > hi) when the key block runs past seqlen_k or the band
               // is narrower than a tile
  __device__ __forceinline__ bool needs_mask(int row_offset) const { return row_offset < lo || row_offset > hi; }
};
__device__ __forceinline__ UnmaskedRows unmasked_rows(FwdParams const& p, int rows, int col_offset, int cols,
                                                      int seqlen_q, int seqlen_k) {
  if (col_offset + cols > seqlen_k) return {INT_MAX, INT_MIN};
  const int diagonal = seqlen_k - seqlen_q;
  // The last column within the band's right edge: row_offset + diagonal + right >= col_offset + cols - 1.
  const int lo = p.window_right >= 0 ? col_offset + cols - 1 - diagonal - p.window_right : INT_MIN;
  // The tile's last row sees the first column: row_offset + rows - 1 + diagonal - left <= col_offset.
  const int hi = p.window_left >= 0 ? col_offset - rows + 1 - diagonal + p.window_left : INT_MAX;
  return {lo, hi};
}

// tanh on the MUFU unit (sm75+), as flash-attn computes softcap: one instruction, relative error about 2^-11,
// below the rounding of the fp16/bf16 probabilities it feeds.
__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ALiBi's slope for (batch, head), negated and in the kernels' score units (divided by score_scale); 0 without ALiBi,
// which adds nothing.
__device__ __forceinline__ float alibi_slope(FwdParams const& p, int batch, int head) {
  return p.alibi_slopes == nullptr ? 0.f : -p.alibi_slopes[batch * p.alibi_batch_stride + head] / p.score_scale;
}

}  // namespace fa2
