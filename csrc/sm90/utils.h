// The Hopper family's vocabulary for register tiles: issuing a warpgroup GEMM, and the views of a wgmma accumulator
// (its rows and columns; the same registers as the A operand of the next GEMM).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace fa2::sm90 {
using namespace cute;

// C (+)= A B over the K blocks of one tile, issued asynchronously by the warpgroup. kZeroInit: the first K block
// overwrites C, so C needs no clearing. kWait: how many wgmma batches may stay in flight on return (-1: the caller
// waits). The operand fences keep the compiler from touching registers an in-flight wgmma reads or writes.
template <bool kZeroInit, int kWait, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TensorA const& tCrA, TensorB const& tCrB, TensorC& tCrC) {
  constexpr bool kRegisterA = !std::is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tCrC);
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
}

// A 64 x N wgmma accumulator per warpgroup is ((2, 2, N/8), 1, 1): thread l of warp w holds rows 16w + l/4 and + 8,
// columns 2 (l % 4) + {0, 1} + 8j. As (rows, columns): (2, N/4), so a row's values sit in the 4 lanes of a quad.
template <class Layout>
__device__ __forceinline__ auto rowcol(Layout const& l) {
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The same registers as a 16-bit A operand of the next GEMM, ((2, 2, 2), 1, N/16): an A fragment of a 64 x 16 block
// is the accumulator pattern of two adjacent 8-column blocks, so only the labels change, no value moves.
template <class Layout>
__device__ __forceinline__ auto as_operand_a(Layout const& l) {
  auto halves = logical_divide(get<0, 2>(l), Tile<_2>{});
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(halves)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(halves), get<2>(l))));
}

// fp32 accumulator -> its Element copy of the same layout, two at a time (cvt.rn.bf16x2 / f16x2).
template <class TensorF, class TensorE>
__device__ __forceinline__ void convert(TensorF const& f, TensorE& out) {
  using Element = typename TensorE::value_type;
  constexpr int kN = decltype(size(f))::value;
  static_assert(kN % 2 == 0 && kN == decltype(size(out))::value);
  auto const& in2 = reinterpret_cast<cutlass::Array<float, 2> const (&)[kN / 2]>(*f.data());
  auto& out2 = reinterpret_cast<cutlass::Array<Element, 2>(&)[kN / 2]>(*out.data());
  cutlass::NumericArrayConverter<Element, float, 2> cvt;
  CUTE_UNROLL
  for (int i = 0; i < kN / 2; ++i) out2[i] = cvt(in2[i]);
}

}  // namespace fa2::sm90
