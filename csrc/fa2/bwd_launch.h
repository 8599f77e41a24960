// Backward: the tile configuration per head dim, and the three launches. Included only by the kernel
// TUs in csrc/kernels/, one (head dim, dtype) each.
#pragma once

#include <cuda_runtime.h>

#include "fa2/bwd_kernel.h"
#include "fa2/launch.h"
#include "fa2/traits.h"

namespace fa2 {

// (kBlockM, kBlockN, Q/dO stages) per head dim. dK and dV live in registers for the whole CTA
// (2 * kBlockN * head_dim / 256 floats per thread), so wide heads get narrower key blocks, and a single
// Q/dO buffer keeps shared memory under the 163 KB an A100 allows per block. head_dim 64 takes 128 query
// rows per block (S/dP in two 64-row passes, traits.h): the dQ GEMM's warps get 32 x 32 slabs and a block
// pays its barriers once per 128 rows, +3-7% on the H100 over 64 rows (bench/NOTES.md v8); 160 KB of smem
// (192 KB on sm90, with the warps' own dQ slabs).
// kStagesBigSmem: the Q/dO stages where a block may use more than an A100's 163 KB (H100: 227 KB). d256 with
// two takes 208 KB; FA2 makes the same choice at run time (bench/NOTES.md v10). Other head dims: not measured.
// kRunningQdO (traits.h): on the H100 +1.6 to +2.6% at d128 (60 B spilled instead of 80), -2 to -5% at d96, 0 to
// -2% at d64, neutral at d256 (bench/NOTES.md v12); other head dims are unmeasured and keep indexed loads.
template <int kHeadDim> struct BwdConfig {
  static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kStages = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kStagesBigSmem = kHeadDim == 256 ? 2 : kStages;
  static constexpr bool kRunningQdO = kHeadDim == 128;
};

// Dynamic shared memory of bwd_kernel: the warps' own dQ slabs come on top where the device runs the sm90 code.
template <typename Traits>
int bwd_smem_bytes() {
  return Traits::kSmemSize + (device_cc_major() >= 9 ? Traits::kDqWarpStageBytes : 0);
}

template <typename Traits>
void launch_bwd(const BwdParams& p, cudaStream_t stream) {
  using Element = typename Traits::Element;
  const int rows_per_cta = kRowKernelWarps * (32 / row_lanes(p.head_dim));  // preprocess / convert
  const dim3 row_grid(ceil_div_host(p.seqlen_q, rows_per_cta), p.nheads, p.batch);

  bwd_preprocess_kernel<Element><<<row_grid, 32 * kRowKernelWarps, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "bwd preprocess launch");

  const int smem = bwd_smem_bytes<Traits>();
  allow_smem<&bwd_kernel<Traits>>(smem, "bwd smem");
  const dim3 grid(ceil_div_host(p.seqlen_k, Traits::kBlockN), p.nheads, p.batch);
  BwdParams main_p = p;  // 8 warps of ~250 registers: one CTA per SM
  if (p.causal && p.head_group == 0) main_p.head_group = causal_head_group(p, grid.x, 1);
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

template <int kHeadDim, DType kDType>
void run_bwd(const BwdParams& p, cudaStream_t stream) {
  using C = BwdConfig<kHeadDim>;
  using Traits = BwdTraits<kHeadDim, C::kBlockM, C::kBlockN, C::kStages, kDType, C::kRunningQdO>;
  if constexpr (C::kStagesBigSmem != C::kStages) {
    using Big = BwdTraits<kHeadDim, C::kBlockM, C::kBlockN, C::kStagesBigSmem, kDType, C::kRunningQdO>;
    if (block_smem_limit(p) >= bwd_smem_bytes<Big>()) return launch_bwd<Big>(p, stream);
  }
  launch_bwd<Traits>(p, stream);
}

}  // namespace fa2
