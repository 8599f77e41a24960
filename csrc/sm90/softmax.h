// The online softmax on a warpgroup's accumulator rows (fa2.reference.flash_fwd_tiled's m, l, acc): each thread holds
// two rows, each spread over the four lanes of a quad (utils.h: rowcol).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/row_end.h"

namespace fa2::sm90 {
using namespace cute;

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x + __shfl_xor_sync(0xffffffff, x, 1);
}

template <int kRows>
struct OnlineSoftmax {
  float m[kRows], l[kRows];  // running max of raw scores; this thread's share of the running sum (summed at the end)
  float rescale[kRows];      // what the last update asks of the output accumulator (rescale_o)

  __device__ __forceinline__ OnlineSoftmax() { reset(); }

  __device__ __forceinline__ void reset() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) m[r] = -INFINITY, l[r] = 0.f, rescale[r] = 1.f;
  }

  // s (rows, columns) holds a key block's raw scores (masked ones -inf); they become unnormalised probabilities
  // exp2(s * scale_log2 - m * scale_log2). The output accumulator is not touched here: the kernel rescales it
  // (rescale_o) later, under the next block's Q K^T. A row that has seen only masked scores keeps m = -inf; its
  // exponent base is taken as 0 so nothing becomes NaN.
  template <bool kFirst, class TensorS>
  __device__ __forceinline__ void update(TensorS& s, float scale_log2) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float row_max = m[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) row_max = fmaxf(row_max, s(r, c));
      row_max = quad_max(row_max);
      const float base = row_max == -INFINITY ? 0.f : row_max * scale_log2;
      // m = -inf: 0, and the accumulator and l are 0 anyway.
      rescale[r] = kFirst ? 1.f : exp2f(m[r] * scale_log2 - base);
      m[r] = row_max;
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(s(r, c) * scale_log2 - base);
        sum += s(r, c);
      }
      l[r] = l[r] * rescale[r] + sum;
    }
  }

  // The output accumulator (rows, columns) to the max of the last update, before that block's P V adds to it.
  template <class TensorO>
  __device__ __forceinline__ void rescale_o(TensorO& acc_o) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) acc_o(r, c) *= rescale[r];
    }
  }

  // Normalises acc_o and returns each row's lse (common/row_end.h: the sink, dropout's out_scale, empty rows).
  template <class TensorO>
  __device__ __forceinline__ void finalize(TensorO& acc_o, float scale, const float* sink, float out_scale,
                                           float (&lse)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const RowEnd end = row_end(m[r], quad_sum(l[r]), scale, sink, out_scale);
      lse[r] = end.lse;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) acc_o(r, c) *= end.o_scale;
    }
  }
};

}  // namespace fa2::sm90
