// Backward: which configuration (config.h) runs, and the three launches. Included only by the kernel TUs in
// csrc/kernels/, one (head dim, dtype) each.
#pragma once

#include <cuda_runtime.h>

#include "fa2/bwd_kernel.h"
#include "fa2/bwd_row_kernels.h"
#include "fa2/config.h"
#include "fa2/launch.h"
#include "fa2/traits.h"

namespace fa2 {

// Dynamic shared memory of bwd_kernel and bwd_dq_kernel: the warps' own dQ slabs come on top where the kernel that
// runs is sm90+ code (kernel_code_arch), the only code that uses them.
template <typename Traits>
int bwd_smem_bytes() {
  if constexpr (Traits::kDqWarpStageBytes == 0) {
    return Traits::kSmemSize;
  } else {
    const bool slabs = kernel_code_arch<&bwd_kernel<Traits>>() >= 90;
    return Traits::kSmemSize + (slabs ? Traits::kDqWarpStageBytes : 0);
  }
}

template <typename Traits>
void launch_bwd(const BwdParams& p, cudaStream_t stream) {
  using Element = typename Traits::Element;
  const int smem = bwd_smem_bytes<Traits>();
  const int limit = block_smem_limit(p);
  if (smem > limit) throw_smem_too_small("backward", p.head_dim, smem, limit);

  const int rows_per_cta = kRowKernelWarps * (32 / row_lanes(p.head_dim));  // preprocess / convert
  const dim3 row_grid(ceil_div_host(p.seqlen_q, rows_per_cta), p.nheads, p.batch);
  bwd_preprocess_kernel<Element><<<row_grid, 32 * kRowKernelWarps, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "bwd preprocess launch");

  allow_smem<&bwd_kernel<Traits>>(smem, "bwd smem");
  const dim3 grid(ceil_div_host(p.seqlen_k, Traits::kBlockN), p.nheads, p.batch);
  BwdParams main_p = p;  // 8 warps of ~250 registers: one CTA per SM
  if (p.causal && p.head_group == 0) main_p.head_group = causal_head_group(p.nheads, device_sm_count(), grid.x);
  bwd_kernel<Traits><<<grid, Traits::kNThreads, smem, stream>>>(main_p);
  check_cuda(cudaGetLastError(), "bwd launch");

  if (p.deterministic) {
    allow_smem<&bwd_dq_kernel<Traits>>(smem, "bwd dq smem");
    const dim3 grid_dq(ceil_div_host(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
    bwd_dq_kernel<Traits><<<grid_dq, Traits::kNThreads, smem, stream>>>(p);
    check_cuda(cudaGetLastError(), "bwd dq launch");
  } else {
    bwd_convert_dq_kernel<Element><<<row_grid, 32 * kRowKernelWarps, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "bwd convert launch");
  }
}

// The first configuration whose shared memory fits: BwdConfig's deeper pipeline (kStagesBigSmem), BwdConfig, then
// the 99 KB one (BwdSmallSmemConfig).
template <int kHeadDim, DType kDType>
void run_bwd(const BwdParams& p, cudaStream_t stream) {
  using C = BwdConfig<kHeadDim>;
  using Main = BwdTraits<kHeadDim, C::kBlockM, C::kBlockN, C::kStages, kDType, C::kRunningQdO>;
  const int limit = block_smem_limit(p);
  if constexpr (C::kStagesBigSmem != C::kStages) {
    using Big = BwdTraits<kHeadDim, C::kBlockM, C::kBlockN, C::kStagesBigSmem, kDType, C::kRunningQdO>;
    if (bwd_smem_bytes<Big>() <= limit) return launch_bwd<Big>(p, stream);
  }
  using Small = BwdSmallSmemConfig<kHeadDim>;
  if constexpr (Small::kEnabled) {
    if (bwd_smem_bytes<Main>() > limit) {
      return launch_bwd<BwdTraits<Small::kKernelHeadDim, Small::kBlockM, Small::kBlockN, Small::kStages, kDType,
                                  false, Small::kPdSInV>>(p, stream);
    }
  }
  launch_bwd<Main>(p, stream);
}

}  // namespace fa2
