// dQ accumulation in the backward with atomics: how one key block's share of dQ (fp32, in the MMA's layout) reaches
// the global accumulator. The path is config.h's policy (dq_path_for) for the arch the code is compiled for, which
// is why every arch-dependent line of the backward is in this header.
#pragma once

#include <cute/tensor.hpp>

#include "sm80/bwd_smem.h"
#include "sm80/config.h"
#include "common/params.h"
#include "sm80/utils.h"

namespace fa2 {
using namespace cute;

// config.h's dQ path for this Traits in the code being compiled: sm90 code has vector atomics
// (red.global.add.v2/v4.f32), and the launch gives it the warps' own slabs.
template <typename Traits>
__device__ constexpr DqPath dq_path() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kSm90 = true;
#else
  constexpr bool kSm90 = false;
#endif
  constexpr bool kFitsInPdS = 2 * Traits::kPdSElems * sizeof(typename Traits::Element) >=
                              Traits::kBlockM * Traits::kHeadDim * sizeof(float);
  return dq_path_for(kSm90, Traits::kDqWarpSlabs, kFitsInPdS, Traits::kHeadDim);
}

// Where dQ is re-tiled for the atomics: the warps' own slabs, else the bytes of sP and sdS.
template <typename Traits>
__device__ float* dq_stage(BwdSmem<Traits> const& smem) {
  if constexpr (dq_path<Traits>() == DqPath::kWarpSlabs) return smem.dq_slabs();
  return reinterpret_cast<float*>(smem.p());
}

// Add one key block's share of dQ into the global accumulator with atomics, the dq_path() way.
// kCheckBounds = false only for whole query blocks with head_dim == kHeadDim, where every row and column
// is in range.
template <typename Traits, bool kCheckBounds, typename Acc, typename Coord>
__device__ __forceinline__ void add_dq_to_accum(Acc const& acc_dq, Coord const& coord, float* smem_stage,
                                                float* dq_accum, int row_offset, int seqlen_q,
                                                BwdParams const& p) {
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  constexpr DqPath kPath = dq_path<Traits>();
  static_assert(kHeadDim % 32 == 0);
  const int rows = seqlen_q - row_offset;
  // Row stride of the accumulator, a constant on whole blocks: there every atomic's address is one base
  // register plus an immediate, instead of a 64-bit multiply-add per atomic.
  const int ld = kCheckBounds ? p.head_dim : kHeadDim;
  float* dq_rows = dq_accum + int64_t(row_offset) * ld;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kPath == DqPath::kWarpSlabs) {
    // Each warp re-tiles its own 32 x 32 slab (traits.h) in its own 4 KB past the block's shared memory,
    // so only the warp synchronises: no CTA barrier before or after. Rows are 128 bytes with the 32-byte
    // blocks XOR-swizzled by row % 4: the fragment's float2 writes (8 rows x 32 bytes) take 2 wavefronts,
    // the float4 reads 4 per 512 bytes, and each float4 atomic instruction covers 4 rows x 128 contiguous
    // bytes, as the CTA-wide re-tiling does.
    constexpr int kSlab = 32;
    static_assert(kBlockM * kHeadDim == 8 * kSlab * kSlab);
    const int lane = threadIdx.x % 32;
    float* stage = smem_stage + (threadIdx.x / 32) * (kSlab * kSlab);
    const int row0 = get<0>(coord(0)) / kSlab * kSlab, col0 = get<1>(coord(0)) / kSlab * kSlab;
    auto stage_index = [](int r, int c) { return r * kSlab + ((((c >> 3) ^ r) & 3) << 3) + (c & 7); };
    __syncwarp();  // this warp is done reading its previous slab
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {  // (i, i+1) are columns (c, c+1) of one row
      const int r = get<0>(coord(i)) - row0, c = get<1>(coord(i)) - col0;
      *reinterpret_cast<float2*>(stage + stage_index(r, c)) = make_float2(acc_dq(i), acc_dq(i + 1));
    }
    __syncwarp();
    const int r_lane = lane / (kSlab / 4), c = (lane % (kSlab / 4)) * 4;
    float* thr_dst = dq_rows + (row0 + r_lane) * ld + col0 + c;
    CUTE_UNROLL
    for (int it = 0; it < kSlab * kSlab / 4 / 32; ++it) {
      const int r = r_lane + it * (32 * 4 / kSlab);
      if (!kCheckBounds || (row0 + r < rows && col0 + c < p.head_dim)) {
        const float4 v = *reinterpret_cast<const float4*>(stage + stage_index(r, c));
        atomicAdd(reinterpret_cast<float4*>(thr_dst + it * (32 * 4 / kSlab) * ld), v);
      }
    }
  } else
#endif
  if constexpr (kPath == DqPath::kStagedInPdS) {
    // Stage layout: row-major (kBlockM, kHeadDim) floats, XOR-swizzled by row % 8 so that the column-pair
    // writes of one MMA fragment (8 rows x 8 columns, 256 bytes) take the minimum 2 wavefronts. The swizzle
    // unit is the 32-byte block those 8 columns fill: 16-byte units send rows g and g + 4 to the same banks
    // (docs/tuning.md#dq-path). Head dims not a multiple of 64 keep 16-byte units, so the XOR stays inside
    // the row.
    auto stage_index = [](int r, int c) {
      if constexpr (kHeadDim % 64 == 0) {
        return r * kHeadDim + (((c >> 3) ^ (r & 7)) << 3) + (c & 7);
      } else {
        return r * kHeadDim + (((c >> 2) ^ (r & 7)) << 2) + (c & 3);
      }
    };
    __syncthreads();  // every warp is done reading sP and sdS
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {  // (i, i+1) are columns (c, c+1) of one row
      const int r = get<0>(coord(i)), c = get<1>(coord(i));
      *reinterpret_cast<float2*>(smem_stage + stage_index(r, c)) = make_float2(acc_dq(i), acc_dq(i + 1));
    }
    __syncthreads();
    // Thread t adds float4 chunks t, t + kNThreads, ... of the row-major tile: consecutive threads take
    // consecutive chunks, so an atomic instruction covers whole rows wherever the rows allow.
    constexpr int kChunksPerRow = kHeadDim / 4, kChunks = kBlockM * kChunksPerRow;
    CUTE_UNROLL
    for (int it = 0; it < ceil_div(kChunks, Traits::kNThreads); ++it) {
      const int chunk = int(threadIdx.x) + it * Traits::kNThreads;
      const int r = chunk / kChunksPerRow, c = chunk % kChunksPerRow * 4;
      if ((kChunks % Traits::kNThreads == 0 || chunk < kChunks) && (!kCheckBounds || (r < rows && c < p.head_dim))) {
        const float4 v = *reinterpret_cast<const float4*>(smem_stage + stage_index(r, c));
        float* dst = dq_rows + r * ld + c;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
        atomicAdd(dst + 0, v.x), atomicAdd(dst + 1, v.y), atomicAdd(dst + 2, v.z), atomicAdd(dst + 3, v.w);
#endif
      }
    }
    // The next iteration's first barrier orders these reads before sP / sdS are rewritten.
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      const int r = get<0>(coord(i)), c = get<1>(coord(i));
      if (!kCheckBounds || (r < rows && c < p.head_dim)) {
        // A 64-bit address per element, not dq_rows + r * ld + c as above: with one base and immediate offsets
        // ptxas keeps every element's address live and spills them (docs/tuning.md#dq-addressing).
        float* dst = dq_accum + int64_t(row_offset + r) * p.head_dim + c;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float2*>(dst), make_float2(acc_dq(i), acc_dq(i + 1)));
#else
        atomicAdd(dst, acc_dq(i)), atomicAdd(dst + 1, acc_dq(i + 1));
#endif
      }
    }
  }
}

}  // namespace fa2
