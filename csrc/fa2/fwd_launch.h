// Forward: which configuration (config.h) runs, and the launch. Included only by the kernel TUs in
// csrc/kernels/, one (head dim, dtype) each.
#pragma once

#include <stdexcept>

#include <cuda_runtime.h>

#include "fa2/config.h"
#include "fa2/fwd_combine.h"
#include "fa2/fwd_kernel.h"
#include "fa2/launch.h"
#include "fa2/traits.h"

namespace fa2 {

template <int kHeadDim, typename Config, DType kDType, bool kUnrollStages = false>
using FwdTraitsOf = FwdTraits<kHeadDim, Config::kBlockM, Config::kBlockN, Config::kNWarps, Config::kStages, kDType,
                              kUnrollStages>;

template <typename Traits, ScoreTransforms kTransforms>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  static_assert(kPageRows % Traits::kBlockN == 0, "a key block lies in one page of a paged cache");
  constexpr int smem = Traits::kSmemSize;
  constexpr auto kernel = &fwd_kernel<Traits, kTransforms>;
  if (params.num_splits > 1 && kTransforms != ScoreTransforms::kLogits) {
    throw std::logic_error("fa2: a split forward reached an instance without split-KV");  // config.h: the host's rule
  }
  const int limit = block_smem_limit(params);
  if (smem > limit) throw_smem_too_small("forward", params.head_dim, smem, limit);
  allow_smem<kernel>(smem, "fwd smem");
  const dim3 grid(ceil_div_host(params.seqlen_q, Traits::kBlockM), params.nheads, params.batch * params.num_splits);
  FwdParams p = params;
  if (p.causal && p.head_group == 0) {
    p.head_group = causal_head_group(p.nheads, device_sm_count() * fwd_ctas_per_sm(Traits::kNWarps), grid.x);
  }
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
  check_cuda(cudaGetLastError(), "fwd launch");
  if (p.num_splits > 1) {
    fwd_combine_kernel<typename Traits::Element><<<unsigned(p.lse_rows), kCombineThreads, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "fwd combine launch");
  }
}

template <int kHeadDim, DType kDType>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Main = FwdTraitsOf<kHeadDim, FwdConfig<kHeadDim>, kDType, kFwdUnrollStages<kHeadDim>>;
  static_assert(Main::kSmemSize == fwd_smem_bytes<FwdConfig<kHeadDim>, kHeadDim>(), "config.h sizes the main tile");
  const bool paged = params.cache.block_table != nullptr;
  if (paged && !fwd_reads_pages<kHeadDim>) throw std::logic_error("fa2: a paged call reached a head dim without pages");
  const FwdTile tile = fwd_tile_for<kHeadDim>(params.seqlen_q, params.seqlen_k, params.causal,
                                              params.rng_state != nullptr, block_smem_limit(params), paged);
  // The narrow tile (short d256 sequences, 99 KB GPUs) runs everything with its one instance, to keep the build
  // smaller; the decode tile (at most 64 query rows) has the kLogits instance: split-KV and the transforms decoding
  // uses; the main tile has an instance per set of transforms (fwd_kernel.h).
  if constexpr (FwdNarrowConfig<kHeadDim>::kEnabled) {
    if (tile == FwdTile::kNarrow) {
      using Narrow = FwdTraitsOf<kHeadDim, FwdNarrowConfig<kHeadDim>, kDType>;
      return launch_fwd<Narrow, ScoreTransforms::kAll>(params, stream);
    }
  }
  if constexpr (FwdDecodeConfig<kHeadDim>::kEnabled) {
    if (tile == FwdTile::kDecode) {
      using Decode = FwdTraitsOf<kHeadDim, FwdDecodeConfig<kHeadDim>, kDType>;
      static_assert(Decode::kSmemSize == fwd_smem_bytes<FwdDecodeConfig<kHeadDim>, kHeadDim>(), "config.h sizes it");
      return launch_fwd<Decode, ScoreTransforms::kLogits>(params, stream);
    }
  }
  switch (score_transforms(params)) {
    case ScoreTransforms::kNone: return launch_fwd<Main, ScoreTransforms::kNone>(params, stream);
    case ScoreTransforms::kLogits: return launch_fwd<Main, ScoreTransforms::kLogits>(params, stream);
    case ScoreTransforms::kAll: return launch_fwd<Main, ScoreTransforms::kAll>(params, stream);
  }
}

}  // namespace fa2
