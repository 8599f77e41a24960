// dQ in the input dtype from inside the persistent Hopper backward (bwd_kernel.h): once every key block that sees a
// query block has added its share into dq_accum, two warps of the producer warpgroup (idle otherwise) scale the fp32
// sums by softmax_scale and round them, as the mma.sync family's convert kernel does after the main kernel
// (sm80/bwd_row_kernels.h), which the persistent tiles then skip.                       docs/tuning.md#sm90-backward
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "sm90/seq_rows.h"

namespace fa2::sm90 {

// How many key blocks add a share into query block m's dQ: those holding a key that one of its rows sees (causal:
// bottom-right aligned, row i sees key j iff j <= i + seqlen_k - seqlen_q), none where no row sees a key.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int dq_visitors(int m, int seqlen_q, int seqlen_k, int n_blocks, bool causal) {
  if (!causal) return n_blocks;
  const int last_key = m * kBlockM + kBlockM - 1 + seqlen_k - seqlen_q;  // the last one the block's rows see
  return last_key < 0 ? 0 : min(n_blocks, last_key / kBlockN + 1);
}

// The converter: warps kConvertWarp and kConvertWarp + 1 of the CTA.
constexpr int kConvertWarp = 2, kConvertThreads = 64;

__device__ __forceinline__ void wait_until_at_least(const int* counter, int target) {
  int seen;
  while (true) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    if (seen >= target) break;
    __nanosleep(256);
  }
}

// CTA c of a grid of G converts query blocks c, c + G, ... of the (batch, head, query block) order, which is the
// order the tiles finish them (bwd_kernel.h: key blocks fastest, then walks, then batch entries; each walk from its
// first query block up). Block j waits until its counter (p.dq_done, laid out (query block, batch, head) as the
// deterministic semaphores) reaches its visitors: the dQ writers release it once their reduce-adds are complete in
// global memory. No tile waits for a conversion, and every tile is drawn from the counter by a CTA that runs, so the
// waits end however many CTAs the GPU holds at once (other streams' kernels may hold SMs). The sums are read
// from L2 (.cg: never a stale L1 line) and dQ written 16 bytes a lane, two chunks in flight (the producer warpgroup's
// 40 registers).
template <int kBlockM, int kBlockN, int kHeadDim, bool kPacks, class Element, class Params>
__device__ __forceinline__ void convert_dq(Params const& p, int thread) {
  constexpr int kChunks = kHeadDim / 8;  // per row: 8 floats in, one 16-byte store out
  const int blocks = p.m_blocks * p.nheads * p.batch;
  const float scale = p.softmax_scale;
  cutlass::NumericArrayConverter<Element, float, 8> cvt;
  for (int j = blockIdx.x; j < blocks; j += gridDim.x) {
    const int m = j % p.m_blocks, head = j / p.m_blocks % p.nheads, batch = j / p.m_blocks / p.nheads;
    const SeqRows seq = seq_rows<kPacks>(p, batch);
    const int row0 = m * kBlockM, rows = min(kBlockM, seq.seqlen_q - row0);
    if (rows <= 0) continue;  // past a packed sequence's end
    const int n_blocks = kPacks ? (seq.seqlen_k + kBlockN - 1) / kBlockN : p.n_blocks;
    wait_until_at_least(p.dq_done + (m * p.batch + batch) * p.nheads + head,
                        dq_visitors<kBlockM, kBlockN>(m, seq.seqlen_q, seq.seqlen_k, n_blocks, p.causal));
    const float* acc = p.dq_accum + (int64_t(stats_row<kPacks>(p, seq, batch, head)) + row0) * kHeadDim;
    Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride +
                  (int64_t(seq.q_start) + row0) * p.dq_row_stride + head * p.dq_head_stride;
    auto load = [&](int c, cutlass::Array<float, 8>& x) {
      const float4* src = reinterpret_cast<const float4*>(acc + (c / kChunks) * kHeadDim + (c % kChunks) * 8);
      reinterpret_cast<float4*>(x.data())[0] = __ldcg(src);
      reinterpret_cast<float4*>(x.data())[1] = __ldcg(src + 1);
    };
    auto store = [&](int c, cutlass::Array<float, 8>& x) {
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) x[i] *= scale;
      const cutlass::Array<Element, 8> y = cvt(x);
      *reinterpret_cast<uint4*>(dq + (c / kChunks) * p.dq_row_stride + (c % kChunks) * 8) =
          *reinterpret_cast<const uint4*>(y.data());
    };
    const int chunks = rows * kChunks;
    for (int c = thread; c < chunks; c += 2 * kConvertThreads) {
      cutlass::Array<float, 8> x0, x1;
      const bool second = c + kConvertThreads < chunks;
      load(c, x0);
      if (second) load(c + kConvertThreads, x1);
      store(c, x0);
      if (second) store(c + kConvertThreads, x1);
    }
  }
}

}  // namespace fa2::sm90
