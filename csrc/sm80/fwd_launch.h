// Forward: the launch of a plan (common/plan.h) on the mma.sync family. Included only by the kernel TUs in
// csrc/instantiations/, one (head dim, dtype) each. The plan chose the tile, the transforms instance, the splits and
// the causal order (host/plan.cpp, from sm80/config.h's table); this file maps them to an instance and launches it.
#pragma once

#include <stdexcept>

#include <cuda_runtime.h>

#include "common/fwd_combine.h"
#include "common/launch.h"
#include "common/pdl.h"
#include "common/plan.h"
#include "sm80/api.h"
#include "sm80/config.h"
#include "sm80/fwd_kernel.h"
#include "sm80/traits.h"

namespace fa2 {

// A tile of the table as kernel traits; the main tile unrolls by its stages where config.h says so.
template <int kHeadDim, FwdTile kTile, DType kDType>
struct FwdTileTraits {
  static constexpr FwdTileShape kShape = fwd_tile_shape(kTile, kHeadDim);
  using type = FwdTraits<kHeadDim, kShape.block_m, kShape.block_n, kShape.warps, kShape.stages, kDType,
                         kTile == FwdTile::kMain && kFwdUnrollStages<kHeadDim>>;
  static_assert(type::kSmemSize == fwd_smem_bytes(kShape, kHeadDim), "config.h sizes the tile");
};
template <int kHeadDim, FwdTile kTile, DType kDType>
using FwdTraitsOf = typename FwdTileTraits<kHeadDim, kTile, kDType>::type;

template <typename Traits, ScoreTransforms kTransforms>
void launch_fwd(const FwdParams& params, bool pdl, cudaStream_t stream) {
  static_assert(kPageRows % Traits::kBlockN == 0, "a key block lies in one page of a paged cache");
  constexpr int smem = Traits::kSmemSize;
  constexpr auto kernel = &fwd_kernel<Traits, kTransforms>;
  const int limit = block_smem_limit(params);
  if (smem > limit) throw_smem_too_small("forward", params.head_dim, smem, limit);
  allow_smem<kernel>(smem, "fwd smem");
  const dim3 grid(ceil_div_host(params.seqlen_q, Traits::kBlockM), params.nheads, params.batch * params.num_splits);
  // Early (common/pdl.h) behind the KV append that ops.cpp launched just before, and the combine behind the splits.
  check_cuda(launch_maybe_early(pdl && params.cache.appended > 0, kernel, grid, dim3(Traits::kNThreads), smem, stream,
                                params),
             "fwd launch");
  if (params.num_splits > 1) {
    check_cuda(launch_maybe_early(pdl, &fwd_combine_kernel<typename Traits::Element>, dim3(unsigned(params.lse_rows)),
                                  dim3(kCombineThreads), 0, stream, params),
               "fwd combine launch");
  }
}

// The instances: the main tile has one per set of transforms (fwd_kernel.h); the narrow tile (short d256 sequences,
// 99 KB GPUs, decodes and paged caches at d160-d256) runs calls with dropout on its kAll instance (d224, d256 only)
// and every other on its kLogits one; the decode tile (at most 64 query rows, d64 and d128) has the kLogits instance:
// split-KV and the transforms decoding uses. host/plan.cpp plans only these.
template <int kHeadDim, DType kDType>
void run_fwd(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
  using Main = FwdTraitsOf<kHeadDim, FwdTile::kMain, kDType>;
  if (p.num_splits != plan.num_splits) throw std::logic_error("fa2: the params' splits are not the plan's");
  if constexpr (fwd_has_narrow_tile(kHeadDim)) {
    using Narrow = FwdTraitsOf<kHeadDim, FwdTile::kNarrow, kDType>;
    if constexpr (fwd_narrow_runs_all(kHeadDim)) {
      if (plan.tile == FwdTile::kNarrow && plan.transforms == ScoreTransforms::kAll && plan.num_splits == 1 &&
          !plan.paged) {
        return launch_fwd<Narrow, ScoreTransforms::kAll>(p, plan.pdl, stream);
      }
    }
    if (plan.tile == FwdTile::kNarrow && plan.transforms == ScoreTransforms::kLogits) {
      return launch_fwd<Narrow, ScoreTransforms::kLogits>(p, plan.pdl, stream);
    }
  }
  if constexpr (fwd_has_decode_tile(kHeadDim)) {
    if (plan.tile == FwdTile::kDecode && plan.transforms == ScoreTransforms::kLogits) {
      using Decode = FwdTraitsOf<kHeadDim, FwdTile::kDecode, kDType>;
      return launch_fwd<Decode, ScoreTransforms::kLogits>(p, plan.pdl, stream);
    }
  }
  const bool splits_ok = plan.num_splits == 1 || plan.transforms == ScoreTransforms::kLogits;
  if (plan.tile == FwdTile::kMain && !plan.paged && splits_ok) {
    switch (plan.transforms) {
      case ScoreTransforms::kNone: return launch_fwd<Main, ScoreTransforms::kNone>(p, plan.pdl, stream);
      case ScoreTransforms::kLogits: return launch_fwd<Main, ScoreTransforms::kLogits>(p, plan.pdl, stream);
      case ScoreTransforms::kAll: return launch_fwd<Main, ScoreTransforms::kAll>(p, plan.pdl, stream);
    }
  }
  throw std::logic_error("fa2: a forward plan without an instance (host/plan.cpp plans only compiled instances)");
}

}  // namespace fa2
