// Forward: the launch of a plan (common/plan.h) on the Hopper family. Included only by the family's kernel TUs in
// csrc/instantiations/ (sm_90a code), one (head dim, dtype) each: builds the TMA descriptors of this call's q, k and
// v and launches one persistent CTA per SM (sm90/tile_scheduler.h hands them the (query block, head, batch) tiles).
#pragma once

#include <algorithm>
#include <stdexcept>

#include <cuda_runtime.h>

#include "common/launch.h"
#include "common/plan.h"
#include "sm90/api.h"
#include "sm90/config.h"
#include "sm90/fwd_kernel.h"
#include "sm90/seq_rows.h"
#include "sm90/traits.h"

namespace fa2::sm90 {

// Varlen's draws (tile_scheduler.h: varlen_tile): workspace[0] = 0, the tile counter; workspace[1 + b] = the query
// blocks of the sequences before b (b = 0..batch), the lengths clamped as the kernel's seq_rows clamps them. One CTA
// of 1024 threads scans the sequences in chunks, with the memset it replaces as the launch's only other work.
template <int kBlockM>
__global__ void __launch_bounds__(1024) varlen_tile_prefix(const int* cu_seqlens_q, int batch, int total_q,
                                                          int max_seqlen_q, int* workspace) {
  __shared__ int warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int carry = 0;
  for (int base = 0; base <= batch; base += blockDim.x) {
    const int b = base + threadIdx.x;  // entry 1 + b sums the sequences before b: an inclusive scan of b - 1's
    int x = b >= 1 && b <= batch ? ceil_div(packed_span(cu_seqlens_q, b - 1, total_q, max_seqlen_q).len, kBlockM) : 0;
    for (int o = 1; o < 32; o *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = lane < int(blockDim.x / 32) ? warp_sums[lane] : 0;
      for (int o = 1; o < 32; o *= 2) {
        const int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      warp_sums[lane] = w;
    }
    __syncthreads();
    x += carry + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (b <= batch) workspace[1 + b] = x;
    carry += warp_sums[31];
    __syncthreads();  // warp_sums is rewritten by the next chunk
  }
  if (threadIdx.x == 0) workspace[0] = 0;
}

template <int kHeadDim, DType kDType>
void run_fwd(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
  constexpr FwdTileShape kTile = fwd_tile(kHeadDim);
  using Traits = FwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.stages, kDType>;
  using Element = typename Traits::Element;
  static_assert(Traits::kSmemSize <= fwd_smem_bytes(kTile, kHeadDim), "config.h sizes the tile");
  if (plan.family != Family::kSm90 || plan.head_dim != kHeadDim || p.head_dim != kHeadDim || p.num_splits != 1 ||
      p.tile_counter == nullptr) {
    throw std::logic_error("fa2: a forward plan the Hopper family does not serve (host/plan.cpp)");
  }
  bind_context();  // before the driver encodes the TMA descriptors
  FwdKernelParams<Traits> k;
  // q, k, v and o as TMA sees them (seq_rows.h: tma_rows_view), V as (head dim, keys, heads, batch) for P V's operand.
  const bool varlen = p.cu_seqlens_q != nullptr;
  auto in = [](const void* ptr) { return static_cast<const Element*>(ptr); };
  Tensor mQ = tma_rows_view<kHeadDim>(in(p.q), p.q_stride, p.seqlen_q, p.nheads, p.batch, p.total_q, varlen);
  Tensor mK = tma_rows_view<kHeadDim>(in(p.k), p.k_stride, p.seqlen_k, p.nheads_k, p.batch, p.total_k, varlen);
  Tensor mVt = tma_rows_view<kHeadDim, true>(in(p.v), p.v_stride, p.seqlen_k, p.nheads_k, p.batch, p.total_k, varlen);
  const auto shape_q = mQ.shape(), shape_k = mK.shape();
  k.tma_q = make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Traits::SmemLayoutQ{},
                          Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{});
  k.tma_k = make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Traits::SmemLayoutK{}),
                          Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{});
  k.tma_v = make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename Traits::SmemLayoutVt{}),
                          Shape<Int<kHeadDim>, Int<Traits::kBlockN>>{}, _1{});
  if constexpr (Traits::kStoreByTma) {
    Element* o = static_cast<Element*>(p.o);
    Tensor mO = tma_rows_view<kHeadDim>(o, p.o_stride, p.seqlen_q, p.nheads, p.batch, p.total_q, varlen);
    k.tma_o = make_tma_copy(SM90_TMA_STORE{}, mO, typename Traits::SmemLayoutO{},
                            Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{});
  }
  k.shape_q = shape_q, k.shape_k = shape_k;
  k.o = static_cast<Element*>(p.o);
  k.o_row_stride = p.o_stride.row, k.o_head_stride = p.o_stride.head, k.o_batch_stride = p.o_stride.batch;
  k.lse = p.lse;
  k.seqlen_q = p.seqlen_q, k.seqlen_k = p.seqlen_k, k.nheads = p.nheads, k.head_group_kv = p.nheads / p.nheads_k;
  k.cu_seqlens_q = p.cu_seqlens_q, k.cu_seqlens_k = p.cu_seqlens_k;
  k.total_q = p.total_q, k.total_k = p.total_k;
  k.scale = p.score_scale, k.scale_log2 = p.scale_log2;
  k.sink = p.sink, k.softcap_in = p.softcap_in;
  k.window_left = p.window_left, k.window_right = p.window_right;
  k.alibi_slopes = p.alibi_slopes, k.alibi_batch_stride = p.alibi_batch_stride;
  k.rng_state = p.rng_state, k.dropout_threshold = p.dropout_threshold, k.dropout_scale = p.dropout_scale;
  // Heaviest-first sections: the (head, batch) pairs whose K and V fill about 32 MB of the L2 (50 MB on an H100).
  // Varlen: the grid is (query blocks of the longest sequence, heads, sequences), of which the producer draws the
  // tiles that have rows (tile_scheduler.h: varlen_tile).
  const int64_t kv_bytes = int64_t(p.seqlen_k) * kHeadDim * 2 * sizeof(Element);
  const int section = int(std::max<int64_t>(1, std::min<int64_t>((32 << 20) / kv_bytes, int64_t(p.nheads) * p.batch)));
  k.scheduler = {ceil_div_host(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch, section,
                 p.window_right >= 0 && p.window_left < 0};
  k.tile_counter = p.tile_counter;

  constexpr int smem = Traits::kSmemSize;
  constexpr auto kernel = &fwd_kernel<Traits>;
  const int limit = block_smem_limit(p);
  if (smem > limit) throw_smem_too_small("forward", p.head_dim, smem, limit);
  allow_smem<kernel>(smem, "sm90 fwd smem");
  // Persistent: one CTA per SM (the shared memory allows no second), each walking its tiles.
  const int grid = std::min(k.scheduler.num_tiles(), device_sm_count());
  if (varlen) {
    varlen_tile_prefix<Traits::kBlockM><<<1, 1024, 0, stream>>>(p.cu_seqlens_q, p.batch, p.total_q, p.seqlen_q,
                                                                k.tile_counter);
    check_cuda(cudaGetLastError(), "sm90 fwd varlen tile prefix");
  } else {
    check_cuda(cudaMemsetAsync(k.tile_counter, 0, sizeof(int), stream), "sm90 fwd tile counter");
  }
  kernel<<<grid, kThreads, smem, stream>>>(k);
  check_cuda(cudaGetLastError(), "sm90 fwd launch");
}

}  // namespace fa2::sm90
