// Small tile operations the kernels are written in: predicated tile copies, the two GEMM shapes
// (both operands from shared memory, or A already in registers), layout views of MMA accumulators,
// and fragment type conversion.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "common/params.h"

namespace fa2 {
using namespace cute;

// Global -> shared tile copy that only reads rows < max_row and columns < max_col of the tile.
// `coord` is the copy partition of an identity tensor: it tells each thread which (row, col) its
// 16-byte chunk covers. Out-of-range chunks are zero-filled in shared memory so that padded keys/values
// contribute exactly nothing (0 * garbage could be NaN). The copy atom is cp.async's zero-fill form: one
// instruction per chunk, predicated by its source size, so the global address is never read there.
template <bool kCheckRows, typename TiledCopy, typename SrcTensor, typename DstTensor, typename CoordTensor>
__device__ __forceinline__ void copy_tile(TiledCopy const& tiled_copy, SrcTensor const& src, DstTensor&& dst,
                                          CoordTensor const& coord, int max_row, int max_col) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool row_ok = !kCheckRows || get<0>(coord(0, m, 0)) < max_row;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      copy(tiled_copy.with(row_ok && get<1>(coord(0, m, k)) < max_col), src(_, m, k), dst(_, m, k));
    }
  }
}

// Shared/registers -> global store of an output tile, predicated the same way (nothing written outside).
template <typename TiledCopy, typename SrcTensor, typename DstTensor, typename CoordTensor>
__device__ __forceinline__ void store_tile(TiledCopy const& tiled_copy, SrcTensor const& src, DstTensor&& dst,
                                           CoordTensor const& coord, int max_row, int max_col) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < max_row) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) {
        if (get<1>(coord(0, m, k)) < max_col) copy(tiled_copy, src(_, m, k), dst(_, m, k));
      }
    }
  }
}

// acc += A * B with both operands in shared memory. Fragments for k-slice i+1 are loaded (ldmatrix)
// before the MMAs of slice i are issued, so shared-memory latency hides behind tensor-core work.
template <typename TiledMma, typename Acc, typename RegA, typename RegB, typename SmemA, typename SmemB,
          typename CopyA, typename CopyB, typename ThrCopyA, typename ThrCopyB>
__device__ __forceinline__ void gemm_ss(TiledMma const& tiled_mma, Acc& acc, RegA& tCrA, RegB& tCrB,
                                        SmemA const& tCsA, SmemB const& tCsB, CopyA const& copy_a,
                                        CopyB const& copy_b, ThrCopyA const& thr_copy_a,
                                        ThrCopyB const& thr_copy_b) {
  Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy(copy_a, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
  copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i + 1 < size<2>(tCrA)) {
      copy(copy_a, tCsA(_, _, i + 1), tCrA_view(_, _, i + 1));
      copy(copy_b, tCsB(_, _, i + 1), tCrB_view(_, _, i + 1));
    }
    gemm(tiled_mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// acc += A * B with A already in registers (P, dS) and B in shared memory.
template <typename TiledMma, typename Acc, typename RegA, typename RegB, typename SmemB, typename CopyB,
          typename ThrCopyB>
__device__ __forceinline__ void gemm_rs(TiledMma const& tiled_mma, Acc& acc, RegA const& tCrA, RegB& tCrB,
                                        SmemB const& tCsB, CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i + 1 < size<2>(tCrA)) copy(copy_b, tCsB(_, _, i + 1), tCrB_view(_, _, i + 1));
    gemm(tiled_mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// View an SM80 accumulator ((2 cols, 2 row halves), MMA_M, MMA_N) as (rows, cols), so softmax and
// masking can loop over the rows a thread owns. Each thread holds 2*MMA_M rows.
template <typename Layout>
__device__ __forceinline__ constexpr auto rowcol_layout(Layout const& acc) {
  static_assert(rank(Layout{}) == 3 && size<0>(Layout{}) == 4);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

// Reinterpret an accumulator of an m16n8 MMA as the A operand of an m16n8k16 MMA: the C fragments of
// two neighbouring n8 tiles are exactly one k16 A fragment, so P (and dS) feed the next GEMM straight
// from registers, with no trip through shared memory.
template <typename Layout>
__device__ __forceinline__ constexpr auto acc_as_operand_a(Layout const& acc) {
  static_assert(rank(Layout{}) == 3 && size<0>(Layout{}) == 4 && size<2>(Layout{}) % 2 == 0);
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2,2), M, (2, N/2))
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// Convert a register fragment elementwise (vectorised: float -> half2/bfloat162 pairs).
// Fragments are compact, so their storage is one contiguous array.
template <typename To, typename Engine, typename Layout>
__device__ __forceinline__ auto convert_type(Tensor<Engine, Layout> const& t) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(t))::value;
  Tensor out = make_tensor<To>(t.layout());
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, N>*>(t.data()));
  return out;
}

}  // namespace fa2
