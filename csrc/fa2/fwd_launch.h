// Forward: the tile configuration per head dim, and the launch. Included only by the kernel TUs in
// csrc/kernels/, one (head dim, dtype) each.
#pragma once

#include <cuda_runtime.h>

#include "fa2/fwd_kernel.h"
#include "fa2/launch.h"
#include "fa2/traits.h"

namespace fa2 {

// (kBlockM, kBlockN, warps, K/V stages) per head dim. Register budget: each thread holds
// kBlockM/(16*warps)*2 rows of acc_o (head_dim/4 floats per row) and of S (kBlockN/4 floats per row); past
// ~255 registers the kernel spills. Larger head dims therefore get narrower K/V tiles or more warps.
// Stages = K/V buffers each. 1 is FA2's schedule (two barriers per key block, each refill behind one).
// 2 gives one barrier per block, block n-1's K and V loading during all of block n's work: on the H100 it
// is +3-5% at d64 (v9) and +1-4% at d96, but -1 to -5% at d128 (v9, v11: 44 B spilled against 24 B) and
// -5 to -8% at d256 (v10), all in bench/NOTES.md. Other head dims are unmeasured and keep 1. d64 and d96 with
// 2 stages take 48 and 72 KB per CTA, so an A100 still holds two.
template <int kHeadDim> struct FwdConfig;
template <> struct FwdConfig<32>  { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 1; };
template <> struct FwdConfig<64>  { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 2; };
template <> struct FwdConfig<96>  { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 2; };
template <> struct FwdConfig<128> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 1; };
template <> struct FwdConfig<160> { static constexpr int kBlockM = 128, kBlockN = 32, kNWarps = 4, kStages = 1; };
template <> struct FwdConfig<192> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8, kStages = 1; };
template <> struct FwdConfig<224> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8, kStages = 1; };
template <> struct FwdConfig<256> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8, kStages = 1; };
// Two stages only: unroll the key-block loop by two, each half on a fixed buffer. d64: +1 to +7% (236 registers
// against 229); d96: -3 to -5%, spilling 40 B at 255 registers (bench/NOTES.md v11).
template <int kHeadDim> constexpr bool kFwdUnrollStages = kHeadDim == 64;

template <int kHeadDim, DType kDType>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Config = FwdConfig<kHeadDim>;
  using Traits = FwdTraits<kHeadDim, Config::kBlockM, Config::kBlockN, Config::kNWarps, Config::kStages, kDType,
                           kFwdUnrollStages<kHeadDim>>;
  constexpr int smem = Traits::kSmemSize;
  constexpr auto kernel = &fwd_kernel<Traits>;
  allow_smem<kernel>(smem, "fwd smem");
  const dim3 grid(ceil_div_host(params.seqlen_q, Traits::kBlockM), params.nheads, params.batch);
  FwdParams p = params;
  // 4 warps at <= 255 registers: two CTAs per SM; 8 warps: one.
  if (p.causal && p.head_group == 0) p.head_group = causal_head_group(p, grid.x, Traits::kNWarps == 4 ? 2 : 1);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
  check_cuda(cudaGetLastError(), "fwd launch");
}

}  // namespace fa2
