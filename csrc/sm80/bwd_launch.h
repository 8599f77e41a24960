// Backward: the launches of a plan (common/plan.h) on the mma.sync family: the preprocess, the main kernel and dQ's
// conversion (or its deterministic kernel). Included only by the kernel TUs in csrc/instantiations/, one (head dim,
// dtype) each. The plan chose the tile and the causal order (host/plan.cpp, from sm80/config.h's table).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>

#include "common/launch.h"
#include "common/plan.h"
#include "sm80/api.h"
#include "sm80/bwd_kernel.h"
#include "sm80/bwd_row_kernels.h"
#include "sm80/config.h"
#include "sm80/traits.h"

namespace fa2 {

// Dynamic shared memory of bwd_kernel and bwd_dq_kernel: the warps' own dQ slabs come on top where the kernel that
// runs is sm90+ code (kernel_code_arch), the only code that uses them.
template <typename Traits>
int bwd_launch_smem() {
  if constexpr (Traits::kDqWarpStageBytes == 0) {
    return Traits::kSmemSize;
  } else {
    const bool slabs = kernel_code_arch<&bwd_kernel<Traits>>() >= 90;
    return Traits::kSmemSize + (slabs ? Traits::kDqWarpStageBytes : 0);
  }
}

template <typename Traits>
void launch_bwd(const BwdParams& p, cudaStream_t stream) {
  constexpr BwdTileShape shape{Traits::kHeadDim, Traits::kBlockM,     Traits::kBlockN,
                               Traits::kStages,   Traits::kRunningQdO, Traits::kPdSInV};
  static_assert(Traits::kSmemSize == bwd_smem_bytes(shape, false) &&
                    Traits::kSmemSize + Traits::kDqWarpStageBytes == bwd_smem_bytes(shape, true),
                "config.h sizes the tile");
  using Element = typename Traits::Element;
  const int smem = bwd_launch_smem<Traits>();
  const int limit = block_smem_limit(p);
  if (smem > limit) throw_smem_too_small("backward", p.head_dim, smem, limit);

  const int rows_per_cta = kRowKernelWarps * (32 / row_lanes(p.head_dim));  // preprocess / convert
  const dim3 row_grid(ceil_div_host(p.seqlen_q, rows_per_cta), p.nheads, p.batch);
  bwd_preprocess_kernel<Element><<<row_grid, 32 * kRowKernelWarps, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "bwd preprocess launch");

  allow_smem<&bwd_kernel<Traits>>(smem, "bwd smem");
  const dim3 grid(ceil_div_host(p.seqlen_k, Traits::kBlockN), p.nheads, p.batch);
  bwd_kernel<Traits><<<grid, Traits::kNThreads, smem, stream>>>(p);
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

// A tile of the table as kernel traits.
template <int kHeadDim, DType kDType, BwdTile kTile>
struct BwdTileTraits {
  static constexpr BwdTileShape kShape = bwd_tile_shape(kTile, kHeadDim);
  using type = BwdTraits<kShape.head_dim, kShape.block_m, kShape.block_n, kShape.stages, kDType, kShape.running_qdo,
                         kShape.pds_in_v>;
};
template <int kHeadDim, DType kDType, BwdTile kTile>
using BwdTraitsOf = typename BwdTileTraits<kHeadDim, kDType, kTile>::type;

template <int kHeadDim, DType kDType>
void run_bwd(const BwdParams& p, const BwdPlan& plan, cudaStream_t stream) {
  if constexpr (bwd_has_deep_tile(kHeadDim)) {
    if (plan.tile == BwdTile::kDeep) return launch_bwd<BwdTraitsOf<kHeadDim, kDType, BwdTile::kDeep>>(p, stream);
  }
  if constexpr (bwd_has_small_smem_tile(kHeadDim)) {
    if (plan.tile == BwdTile::kSmallSmem) {
      return launch_bwd<BwdTraitsOf<kHeadDim, kDType, BwdTile::kSmallSmem>>(p, stream);
    }
  }
  if (plan.tile == BwdTile::kMain) return launch_bwd<BwdTraitsOf<kHeadDim, kDType, BwdTile::kMain>>(p, stream);
  throw std::logic_error("fa2: a backward plan without an instance (host/plan.cpp plans only compiled tiles)");
}

}  // namespace fa2
