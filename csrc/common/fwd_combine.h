// Split-KV's second step: each row's partial results, one per split of its keys (fwd_kernel.h), merged into o and
// lse. A split with lse_s over its keys and O_s normalised over them contributes exp(lse_s - lse) O_s, where
// lse = log(sum_s exp(lse_s) + exp(sink)); empty splits have lse_s = -inf and weigh nothing. One block per row: a
// decode has few rows (32 at batch 1), so a warp per row would leave most SMs idle and each lane's loads one split
// after another; instead the splits of a row are spread over the block's threads, each reading 16-byte chunks
// (docs/tuning.md#split-kv). Full-precision expf and logf: lse's error budget is float32 attention's.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "common/pdl.h"

namespace fa2 {

constexpr int kCombineThreads = 128;
static_assert(kMaxSplits <= kCombineThreads, "one split's lse per thread");

template <typename Element>
__global__ void __launch_bounds__(kCombineThreads) fwd_combine_kernel(const __grid_constant__ FwdParams p) {
  constexpr int kWarps = kCombineThreads / 32;
  __shared__ float weights[kMaxSplits];
  __shared__ float warp_values[kWarps];
  __shared__ float4 group_sums[kCombineThreads];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t row = blockIdx.x;  // the grid has one block per lse row

  // Which (batch, head, query) this lse row is: lse is (batch, nheads, seqlen_q), or (nheads, total_q) packed.
  int64_t o_offset;
  int head;
  if (p.cu_seqlens_q == nullptr) {
    const int64_t query = row % p.seqlen_q, batch_head = row / p.seqlen_q;
    head = int(batch_head % p.nheads);
    o_offset = batch_head / p.nheads * p.o_stride.batch + query * p.o_stride.row + head * p.o_stride.head;
  } else {
    head = int(row / p.total_q);
    o_offset = row % p.total_q * p.o_stride.row + head * p.o_stride.head;
  }

  // The block's max or sum of one value per thread.
  auto block_reduce = [&](float x, auto op) {
    for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
    if (lane == 0) warp_values[warp] = x;
    __syncthreads();
    x = warp_values[0];
    for (int w = 1; w < kWarps; ++w) x = op(x, warp_values[w]);
    __syncthreads();  // warp_values is reused
    return x;
  };
  const float sink = p.sink == nullptr ? -INFINITY : p.sink[head];
  wait_for_previous_kernel();  // launched early behind the forward's splits (pdl.h): their results are read below
  const float lse_s = tid < p.num_splits ? p.lse_partial[tid * p.lse_rows + row] : -INFINITY;  // split tid's
  const float m = fmaxf(sink, block_reduce(lse_s, [](float a, float b) { return fmaxf(a, b); }));
  float l = block_reduce(m == -INFINITY ? 0.f : expf(lse_s - m), [](float a, float b) { return a + b; });
  if (m != -INFINITY) l += expf(sink - m);
  const bool empty = l == 0.f;  // no key in any split and no sink: O = 0, lse = -inf, as fwd_kernel.h's rows
  const float lse = empty ? -INFINITY : m + logf(l);
  if (tid < p.num_splits) weights[tid] = empty ? 0.f : expf(lse_s - lse);
  __syncthreads();

  // O: the row's 16-byte chunks (head_dim is a multiple of 8) over the threads, and the splits over `groups` groups
  // of threads, each summing every groups-th split; the groups' sums meet in shared memory.
  const int chunks = p.head_dim / 4, groups = kCombineThreads / chunks;
  const int chunk = tid % chunks, group = tid / chunks;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (group < groups) {
    const float4* src = reinterpret_cast<const float4*>(p.o_partial + row * p.head_dim) + chunk;
    const int64_t split_stride = p.lse_rows * p.head_dim / 4;  // in chunks
#pragma unroll 4
    for (int s = group; s < p.num_splits; s += groups) {
      const float w = weights[s];
      const float4 x = src[s * split_stride];
      acc.x += w * x.x, acc.y += w * x.y, acc.z += w * x.z, acc.w += w * x.w;
    }
  }
  group_sums[tid] = acc;
  __syncthreads();
  if (tid < chunks) {
    for (int g = 1; g < groups; ++g) {
      const float4 x = group_sums[g * chunks + tid];
      acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
    }
    Element* o = static_cast<Element*>(p.o) + o_offset + 4 * tid;
    o[0] = Element(acc.x), o[1] = Element(acc.y), o[2] = Element(acc.z), o[3] = Element(acc.w);
  }
  if (tid == 0) p.lse[row] = lse;
}

}  // namespace fa2
