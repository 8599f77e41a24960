// dQ's staging in the Hopper backward (bwd_kernel.h; bwd_mma_wide.h per 128-column half): an MMA thread's share
// of a query block's dQ, from its accumulator into the fp32 staging tile, row-major (query, column) under the
// 128-byte swizzle, which the dQ writer's TMA reduce-add reads (bwd_traits.h: SmemLayoutdQ, the warpgroups' slabs).
// Host and device, so that bench/dq_swap_maps.cu checks this code's addresses and bank conflicts.
//                                                                                      docs/tuning.md#sm90-backward
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/bwd_traits.h"

namespace fa2::sm90 {
using namespace cute;

// dQ's staging slab of MMA warpgroup w (ids + w): empty (the writer's reduce has read it; the MMA warpgroup waits) and
// full (the MMA warpgroup wrote it; the writer waits). 128 MMA threads and the writer warp's 32 each.
constexpr int kdQEmpty = 1, kdQFull = 1 + kBwdMmaWarpgroups;
constexpr int kdQThreads = kWarpgroupThreads + 32;

// Called once per query block (the wide tile: per half); the addresses do not depend on the block, and the compiler
// keeps them from the first (a base register per row parity and column group, the rest immediate offsets).
template <class Traits, class Frag>
CUTE_HOST_DEVICE void stage_dq(typename Traits::TiledMmadQ const& mma, int tid, Frag const& tdQrdQ, float* smem) {
  if constexpr (!Traits::kdQSwapAB) {
    // dQ (queries, columns): a thread's value pairs are adjacent columns of one row, 64-bit stores.
    Tensor sdQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutdQ{});
    auto r2s = make_tiled_copy_C(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<64>, float>{}, mma);
    auto thr = r2s.get_thread_slice(tid);
    copy(r2s, thr.retile_S(tdQrdQ), thr.partition_D(as_position_independent_swizzle_tensor(sdQ)));
  } else {
    // dQ^T (columns, queries), through the transposed view: a thread's value pairs are one column of two queries,
    // two rows apart, so each store is one float. A store's 32 lanes are 8 columns of 4 same-parity rows, which the
    // swizzle (rows XOR 16-byte column groups) spreads over the 32 banks.
    Tensor sdQt = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutdQt{});
    auto r2s = make_tiled_copy_C(Copy_Atom<UniversalCopy<float>, float>{}, mma);
    auto thr = r2s.get_thread_slice(tid);
    copy(r2s, thr.retile_S(tdQrdQ), thr.partition_D(as_position_independent_swizzle_tensor(sdQt)));
  }
}

// A key block's dQ share to the writer warp: into the slab once the writer's previous reduce has read it, then made
// visible to TMA (the async proxy) and handed over.
template <class Traits, class Frag>
__device__ __forceinline__ void hand_dq_to_writer(typename Traits::TiledMmadQ const& mma, int tid, Frag const& tdQrdQ,
                                                  float* smem, int mma_warpgroup) {
  cutlass::arch::NamedBarrier::sync(kdQThreads, kdQEmpty + mma_warpgroup);
  stage_dq<Traits>(mma, tid, tdQrdQ, smem);
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::arrive(kdQThreads, kdQFull + mma_warpgroup);
}

}  // namespace fa2::sm90
