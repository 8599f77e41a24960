// Online softmax of FlashAttention-2 (reference.py: flash_fwd_tiled), in registers, base 2.
// Per row a thread keeps m (running max of raw scores) and a partial l (its own columns' share of the
// running sum); the four threads of an MMA quad that share a row combine l only once, at the end.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "common/row_end.h"
#include "sm80/utils.h"

namespace fa2 {
using namespace cute;

// The four lanes of a quad hold the columns of the same accumulator rows.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

template <int kNRows>
struct OnlineSoftmax {
  float row_max[kNRows];  // m
  float row_sum[kNRows];  // l (this thread's partial)

  __device__ __forceinline__ OnlineSoftmax() {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) row_max[mi] = -INFINITY, row_sum[mi] = 0.f;
  }

  // One K/V tile: raise m, turn the scores in acc_s into P = exp2(S*scale_log2 - m*scale_log2) in place,
  // and rescale l and acc_o by exp2((m_old - m_new)*scale_log2). On the first tile m_old = -inf, so the
  // correction is 0 and acc_o (still zero) stays zero: no special first iteration.
  // With kRowBias the tile holds S - row_bias (a term constant along each row, deferred: ALiBi's, mask.h
  // apply_alibi_split): m and P are still those of S, at one FADD per row instead of one per score.
  // fixed_max: m was set once (fix_max) to a bound of every score, so there is nothing to raise or rescale.
  template <bool kRowBias = false, typename TensorS, typename TensorO>
  __device__ __forceinline__ void update(TensorS& acc_s, TensorO& acc_o, float scale_log2,
                                         const float* row_bias = nullptr, bool fixed_max = false) {
    if (!fixed_max) rescale<kRowBias>(acc_s, acc_o, scale_log2, row_bias);
    exponentiate<kRowBias>(acc_s, scale_log2, row_bias);
  }

  // Use m = `m` for every row from here on, without a running max: only where every score s is known to keep
  // exp2((s - m) * scale_log2) and the sums of those within fp32 (the forward's softcap, whose scores are tanh values).
  __device__ __forceinline__ void fix_max(float m) {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) row_max[mi] = m;
  }

  // update()'s first half: raise m where needed, rescaling l and acc_o by the correction.
  template <bool kRowBias = false, typename TensorS, typename TensorO>
  __device__ __forceinline__ void rescale(TensorS const& acc_s, TensorO& acc_o, float scale_log2,
                                          const float* row_bias = nullptr) {
    Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
    Tensor o = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));
    static_assert(decltype(size<0>(s))::value == kNRows);
    // Lazy rescale: m stays where it is until some row of the warp has outgrown it by more than 2^8. P then
    // stays <= 256, harmless in fp32 sums and in fp16/bf16 P, and l, acc_o and lse all refer to the same m,
    // so the result is the same softmax. Late tiles rarely raise the max by that much, so most tiles skip
    // the rescale of acc_o (head_dim/4 FMULs per row, on the critical path to O += P V). The test needs no
    // shuffles: a row's max over its quad outgrows m only if one lane's scores do, so the quads combine
    // their maxima (quad_max) only when the warp rescales. The vote keeps the branch warp-uniform.
    float thread_max[kNRows];
    bool grew = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float m = kRowBias ? -INFINITY : row_max[mi];
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) m = fmaxf(m, s(mi, ni));
      if constexpr (kRowBias) m = fmaxf(row_max[mi], m + row_bias[mi]);  // -inf + bias stays -inf
      thread_max[mi] = m;
      // A row's first finite score always rescales (whatever the scale); -inf only stays -inf.
      grew |= row_max[mi] == -INFINITY ? m != -INFINITY : (m - row_max[mi]) * scale_log2 > 8.f;
    }
    if (__any_sync(0xffffffff, grew)) {
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) {
        const float m = quad_max(thread_max[mi]);
        // m_old = -inf (no key seen yet): correction 0, never NaN; m_old finite means m is too.
        const float correction = row_max[mi] == -INFINITY ? 0.f : exp2f((row_max[mi] - m) * scale_log2);
        row_max[mi] = m;
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(o); ++ni) o(mi, ni) *= correction;
        row_sum[mi] *= correction;
      }
    }
  }

  // ... and turn S into P in place, adding to l.
  template <bool kRowBias = false, typename TensorS>
  __device__ __forceinline__ void exponentiate(TensorS& acc_s, float scale_log2,
                                               const float* row_bias = nullptr) {
    Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      // Offset by 0 for a row with m = -inf, so exp2 yields 0, not NaN.
      float m = row_max[mi];
      if constexpr (kRowBias) m -= row_bias[mi];  // the tile's scores lack the row's bias
      const float m_scaled = row_max[mi] == -INFINITY ? 0.f : m * scale_log2;
      float sum = row_sum[mi];
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) {
        s(mi, ni) = exp2f(s(mi, ni) * scale_log2 - m_scaled);  // one FFMA + one MUFU.EX2
        sum += s(mi, ni);
      }
      row_sum[mi] = sum;
    }
  }

  // O = acc / l (times dropout's out_scale) and each row's lse (common/row_end.h: the sink, empty rows).
  template <typename TensorO>
  __device__ __forceinline__ void finalize(TensorO& acc_o, float scale, const float* sink, float out_scale,
                                           float (&lse)[kNRows]) {
    Tensor o = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const RowEnd end = row_end(row_max[mi], quad_sum(row_sum[mi]), scale, sink, out_scale);
      lse[mi] = end.lse;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(o); ++ni) o(mi, ni) *= end.o_scale;
    }
  }
};

}  // namespace fa2
