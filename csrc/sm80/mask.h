// The band (common/band.h), softcapping and ALiBi applied to the mma.sync family's score fragments.
#pragma once

#include <climits>
#include <cmath>
#include <cute/tensor.hpp>

#include "common/band.h"
#include "common/params.h"
#include "sm80/utils.h"

namespace fa2 {
using namespace cute;

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

// Softcap, before any mask (tanh would turn -inf into -1): raw scores s become tanh(s * softcap_in); the
// softmax scales them by score_scale = softcap.
template <typename TensorS>
__device__ __forceinline__ void apply_softcap(TensorS& acc_s, float softcap_in) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc_s); ++i) acc_s(i) = tanh_fast(acc_s(i) * softcap_in);
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
