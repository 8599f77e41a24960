// The visible band of keys and sequence-end masking, which key blocks a query block visits and which query
// blocks a key block is seen by; softcapping and ALiBi biases of raw scores.
// Query row i sees key j iff j < seqlen_k and i + diagonal - left <= j <= i + diagonal + right, with
// diagonal = seqlen_k - seqlen_q and left/right = window_left/window_right, -1 for an unbounded side
// (causal: right = 0).
#pragma once

#include <climits>
#include <cmath>
#include <cute/tensor.hpp>

#include "fa2/params.h"
#include "fa2/utils.h"

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

// Set scores outside the band or past seqlen_k to -inf. `coord` is the MMA partition of an identity tensor
// over the score tile, so coord(i) is the (row, col) within the tile of acc_s(i).
// kLeftBand = false: the caller knows window_left < 0 (the forward's plain instance), so only the right edge is tested.
template <bool kLeftBand = true, typename TensorS, typename CoordS>
__device__ __forceinline__ void apply_mask(TensorS& acc_s, CoordS const& coord, FwdParams const& p, int row_offset,
                                           int col_offset, int seqlen_q, int seqlen_k) {
  Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
  Tensor c = make_tensor(coord.data(), rowcol_layout(coord.layout()));
  const int diagonal = seqlen_k - seqlen_q;
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    const int row = row_offset + get<0>(c(mi, 0));
    const int col_begin = kLeftBand && p.window_left >= 0 ? row + diagonal - p.window_left : INT_MIN;
    const int col_end = p.window_right >= 0 ? min(seqlen_k, row + diagonal + p.window_right + 1) : seqlen_k;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) {
      const int col = col_offset + get<1>(c(0, ni));
      if (col >= col_end || (kLeftBand && col < col_begin)) s(mi, ni) = -INFINITY;
    }
  }
}

// tanh on the MUFU unit (sm75+), as flash-attn computes softcap: one instruction, relative error about 2^-11,
// below the rounding of the fp16/bf16 probabilities it feeds.
__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Softcap, before any mask (tanh would turn -inf into -1): raw scores s become tanh(s * softcap_in); the
// softmax scales them by score_scale = softcap.
template <typename TensorS>
__device__ __forceinline__ void apply_softcap(TensorS& acc_s, float softcap_in) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc_s); ++i) acc_s(i) = tanh_fast(acc_s(i) * softcap_in);
}

// ALiBi's slope for (batch, head), negated and in the kernels' score units (divided by score_scale); 0 without ALiBi,
// which adds nothing.
__device__ __forceinline__ float alibi_slope(FwdParams const& p, int batch, int head) {
  return p.alibi_slopes == nullptr ? 0.f : -p.alibi_slopes[batch * p.alibi_batch_stride + head] / p.score_scale;
}

// ALiBi's distance row + diagonal - col for the scores of a tile, in fp32 without a conversion per score: a thread's
// columns differ from its first by constants of the MMA layout, so distance(mi, ni) = row_distance(mi) - col_step(ni)
// is one subtraction of an immediate from a value converted once per row. (Conversions run at exp2's MUFU rate,
// which small head dims already saturate; a per-column array would cost the forward's loop registers it has not
// got.) Positions below 2^24 are exact in fp32, so the distances are exact. `c` is the tile's coordinates in
// (row, col) form.
template <typename CoordRC>
__device__ __forceinline__ float alibi_row_distance(CoordRC const& c, int mi, int row_offset, int col_offset,
                                                    int diagonal) {
  return float(row_offset + get<0>(c(mi, 0)) + diagonal - col_offset - get<1>(c(0, 0)));
}
template <typename CoordRC>
__device__ __forceinline__ float alibi_col_step(CoordRC const& c, int ni) {
  return float(get<1>(c(0, ni)) - get<1>(c(0, 0)));
}

// Add the ALiBi bias slope * |row + diagonal - col| to every score of the tile (after softcap, which it does not go
// through).
template <typename TensorS, typename CoordS>
__device__ __forceinline__ void apply_alibi(TensorS& acc_s, CoordS const& coord, float slope, int row_offset,
                                            int col_offset, int diagonal) {
  Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
  Tensor c = make_tensor(coord.data(), rowcol_layout(coord.layout()));
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    const float row_distance = alibi_row_distance(c, mi, row_offset, col_offset, diagonal);
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) s(mi, ni) += slope * fabsf(row_distance - alibi_col_step(c, ni));
  }
}

// ALiBi on a tile that lies on one side of the diagonal, every distance of sign `sign` (+1 or -1): the bias
// slope * sign * (row_distance(mi) - col_step(ni)) splits into a column term added here (one FMUL per column, one FADD
// per score, where apply_alibi has an FADD and an FFMA per score) and a row term returned in row_bias, which the
// softmax adds to the row's max (OnlineSoftmax::update<kRowBias>).
template <typename TensorS, typename CoordS, int kRows>
__device__ __forceinline__ void apply_alibi_split(TensorS& acc_s, CoordS const& coord, float slope, int sign,
                                                  int row_offset, int col_offset, int diagonal,
                                                  float (&row_bias)[kRows]) {
  Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
  Tensor c = make_tensor(coord.data(), rowcol_layout(coord.layout()));
  static_assert(decltype(size<0>(s))::value == kRows);
  const float signed_slope = sign > 0 ? slope : -slope;
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    row_bias[mi] = signed_slope * alibi_row_distance(c, mi, row_offset, col_offset, diagonal);
  }
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(s); ++ni) {
    const float col_bias = -signed_slope * alibi_col_step(c, ni);
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) s(mi, ni) += col_bias;
  }
}

}  // namespace fa2
