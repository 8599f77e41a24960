// Forward: the tile configuration per head dim, and the launch. Included only by the kernel TUs in
// csrc/kernels/, one (head dim, dtype) each.
#pragma once

#include <cuda_runtime.h>

#include "fa2/fwd_kernel.h"
#include "fa2/launch.h"
#include "fa2/traits.h"

namespace fa2 {

// (kBlockM, kBlockN, warps) per head dim. Register budget: each thread holds kBlockM/(16*warps)*2 rows
// of acc_o (head_dim/4 floats per row) and of S (kBlockN/4 floats per row); past ~255 registers the
// kernel spills. Larger head dims therefore get narrower K/V tiles or more warps.
template <int kHeadDim> struct FwdConfig;
template <> struct FwdConfig<32>  { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4; };
template <> struct FwdConfig<64>  { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4; };
template <> struct FwdConfig<96>  { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4; };
template <> struct FwdConfig<128> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4; };
template <> struct FwdConfig<160> { static constexpr int kBlockM = 128, kBlockN = 32, kNWarps = 4; };
template <> struct FwdConfig<192> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8; };
template <> struct FwdConfig<224> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8; };
template <> struct FwdConfig<256> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8; };

template <int kHeadDim, DType kDType>
void run_fwd(const FwdParams& p, cudaStream_t stream) {
  using Config = FwdConfig<kHeadDim>;
  using Traits = FwdTraits<kHeadDim, Config::kBlockM, Config::kBlockN, Config::kNWarps, kDType>;
  constexpr int smem = Traits::kSmemSize;
  constexpr auto kernel = &fwd_kernel<Traits>;
  allow_smem<kernel>(smem, "fwd smem");
  const dim3 grid(ceil_div_host(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
  check_cuda(cudaGetLastError(), "fwd launch");
}

}  // namespace fa2
