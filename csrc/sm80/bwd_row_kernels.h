// The backward's two row-wise kernels, around the main loop (bwd_kernel.h): bwd_preprocess_kernel computes
// D = rowsum(dO * O) and zeroes the fp32 dQ accumulator before it, bwd_convert_dq_kernel writes dQ in the input
// dtype after it. Each row gets row_lanes(head_dim) lanes (config.h).
#pragma once

#include <cute/tensor.hpp>

#include "sm80/config.h"
#include "common/params.h"
#include "common/seqlen.h"

namespace fa2 {
using namespace cute;

// D = rowsum(dO * O) in fp32, and the fp32 dQ accumulator zeroed (atomics add into it).
template <typename Element>
__global__ void bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
  const int lanes = row_lanes(p.head_dim), lane = threadIdx.x % 32, sub = lane % lanes;
  const int row = (blockIdx.x * kRowKernelWarps + threadIdx.x / 32) * (32 / lanes) + lane / lanes;
  const int head = blockIdx.y, batch = blockIdx.z;
  // The persistent Hopper backward's tile counter (sm90/bwd_kernel.h), zeroed here rather than by a launch of its own.
  if (p.tile_counter != nullptr && (blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x) == 0) *p.tile_counter = 0;
  const SeqInfo seq(p, batch, head);
  const bool valid = row < seq.seqlen_q;
  float dot = 0.f;
  if (valid) {
    const Element* dout = &seq.q_tensor<8, const Element>(p.dout, p.dout_stride, batch, head)(row, 0);
    const Element* out = &seq.q_tensor<8, const Element>(p.o, p.o_stride, batch, head)(row, 0);
    for (int c = sub * 8; c < p.head_dim; c += lanes * 8) {
      const uint4 a = *reinterpret_cast<const uint4*>(dout + c);
      const uint4 b = *reinterpret_cast<const uint4*>(out + c);
      const Element* ea = reinterpret_cast<const Element*>(&a);
      const Element* eb = reinterpret_cast<const Element*>(&b);
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) dot += float(ea[i]) * float(eb[i]);
    }
  }
  for (int offset = lanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffff, dot, offset);
  if (!valid) return;
  const int64_t bh_row = seq.stats_row + row;
  if (sub == 0) p.d_sum[bh_row] = dot;
  // mma.sync's deterministic dQ comes from bwd_dq_kernel (the accumulator unused); the Hopper one still adds into it.
  if (p.deterministic && p.dq_semaphore == nullptr) return;
  float* dq_accum = p.dq_accum + bh_row * p.head_dim;
  for (int c = sub * 4; c < p.head_dim; c += lanes * 4) *reinterpret_cast<float4*>(dq_accum + c) = float4{0, 0, 0, 0};
}

// dQ = softmax_scale * dQ_accum in the input dtype: 8 floats in, one 16-byte store out per lane and step.
template <typename Element>
__global__ void bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
  const int lanes = row_lanes(p.head_dim), lane = threadIdx.x % 32, sub = lane % lanes;
  const int row = (blockIdx.x * kRowKernelWarps + threadIdx.x / 32) * (32 / lanes) + lane / lanes;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq(p, batch, head);
  if (row >= seq.seqlen_q) return;
  const float* acc = p.dq_accum + (seq.stats_row + row) * p.head_dim;
  Element* dq = &seq.q_tensor<8, Element>(p.dq, p.dq_stride, batch, head)(row, 0);
  for (int c = sub * 8; c < p.head_dim; c += lanes * 8) {
    const float4 a = *reinterpret_cast<const float4*>(acc + c);
    const float4 b = *reinterpret_cast<const float4*>(acc + c + 4);
    const float s = p.softmax_scale;
    const Element e[8] = {Element(a.x * s), Element(a.y * s), Element(a.z * s), Element(a.w * s),
                          Element(b.x * s), Element(b.y * s), Element(b.z * s), Element(b.w * s)};
    *reinterpret_cast<uint4*>(dq + c) = *reinterpret_cast<const uint4*>(e);
  }
}

}  // namespace fa2
