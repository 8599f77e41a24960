// Forward: the tile configuration per head dim, and the launch. Included only by the kernel TUs in
// csrc/kernels/, one (head dim, dtype) each.
#pragma once

#include <algorithm>

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

// Short sequences at d256: FA2's own tile, 64 x 64 on 4 warps, two CTAs per SM, where the 8-warp tile's one CTA per
// SM leaves its Q load, barriers and epilogue exposed (a CTA visits few key blocks). On the H100: +4 to +6% at
// 512-1k non-causal, +17% at 512 and +6% at 2k causal; the causal rows at 8k lose 6% (bench/NOTES.md v10, v12).
template <int kHeadDim> struct FwdShortConfig { static constexpr int kMaxSeqlen = 0, kMaxSeqlenCausal = 0; };
template <> struct FwdShortConfig<256> {
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4, kStages = 1;
  static constexpr int kMaxSeqlen = 1024, kMaxSeqlenCausal = 2048;  // max(seqlen_q, seqlen_k) up to which it runs
};

template <typename Traits>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
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

template <int kHeadDim, DType kDType>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Short = FwdShortConfig<kHeadDim>;
  if constexpr (Short::kMaxSeqlen > 0) {
    const int seqlen = std::max(params.seqlen_q, params.seqlen_k);
    if (seqlen <= (params.causal ? Short::kMaxSeqlenCausal : Short::kMaxSeqlen)) {
      return launch_fwd<FwdTraits<kHeadDim, Short::kBlockM, Short::kBlockN, Short::kNWarps, Short::kStages, kDType>>(
          params, stream);
    }
  }
  using Config = FwdConfig<kHeadDim>;
  launch_fwd<FwdTraits<kHeadDim, Config::kBlockM, Config::kBlockN, Config::kNWarps, Config::kStages, kDType,
                       kFwdUnrollStages<kHeadDim>>>(params, stream);
}

}  // namespace fa2
