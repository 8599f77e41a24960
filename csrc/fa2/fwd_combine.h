// Split-KV's second step: each row's partial results, one per split of its keys (fwd_kernel.h), merged into o and
// lse. A split with lse_s over its keys and O_s normalised over them contributes exp(lse_s - lse) O_s, where
// lse = log(sum_s exp(lse_s) + exp(sink)); empty splits have lse_s = -inf and weigh nothing. One warp per row: the
// splits' weights go through shared memory, then each lane sums its columns over the splits. Full-precision expf and
// logf: the combine handles a decode's few rows, and lse's error budget is float32 attention's.
#pragma once

#include <cuda_runtime.h>

#include "fa2/config.h"
#include "fa2/params.h"

namespace fa2 {

constexpr int kCombineWarps = 4;

template <typename Element>
__global__ void __launch_bounds__(32 * kCombineWarps) fwd_combine_kernel(const __grid_constant__ FwdParams p) {
  __shared__ float weights[kCombineWarps][kMaxSplits];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + warp;
  if (row >= p.lse_rows) return;

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

  const float sink = p.sink == nullptr ? -INFINITY : p.sink[head];
  float m = sink;
  for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, p.lse_partial[s * p.lse_rows + row]);
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  float l = 0.f;
  if (m != -INFINITY) {
    for (int s = lane; s < p.num_splits; s += 32) l += expf(p.lse_partial[s * p.lse_rows + row] - m);
    for (int offset = 16; offset > 0; offset /= 2) l += __shfl_xor_sync(0xffffffffu, l, offset);
    l += expf(sink - m);
  }
  const bool empty = l == 0.f;  // no key in any split and no sink: O = 0, lse = -inf, as fwd_kernel.h's rows
  const float lse = empty ? -INFINITY : m + logf(l);
  for (int s = lane; s < p.num_splits; s += 32) {
    weights[warp][s] = empty ? 0.f : expf(p.lse_partial[s * p.lse_rows + row] - lse);
  }
  __syncwarp();

  Element* o = static_cast<Element*>(p.o) + o_offset;
  for (int col = lane; col < p.head_dim; col += 32) {
    float acc = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      acc += weights[warp][s] * p.o_partial[(s * p.lse_rows + row) * p.head_dim + col];
    }
    o[col] = Element(acc);
  }
  if (lane == 0) p.lse[row] = lse;
}

}  // namespace fa2
