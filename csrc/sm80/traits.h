// What a configuration's numbers (config.h) imply: shared-memory layouts and sizes, copy and MMA atoms, the warps'
// arrangement of each GEMM. The kernels are generic over a Traits type; changing a tile shape never touches a
// mainloop.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/dtype.h"

namespace fa2 {
using namespace cute;

template <DType> struct ElementOf;
template <> struct ElementOf<DType::fp16> {
  using type = cutlass::half_t;
  using MmaAtom = SM80_16x8x16_F32F16F16F32_TN;
};
template <> struct ElementOf<DType::bf16> {
  using type = cutlass::bfloat16_t;
  using MmaAtom = SM80_16x8x16_F32BF16BF16F32_TN;
};

// Pieces shared by the forward and backward traits.
template <int kHeadDim_, int kNWarps_, DType kDType>
struct BaseTraits {
  using Element = typename ElementOf<kDType>::type;
  using MmaAtom = typename ElementOf<kDType>::MmaAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;

  // Shared-memory rows are handled in chunks of 64 elements (128 bytes) where the head dim allows,
  // else 32. The XOR swizzle spreads the 8 rows that one ldmatrix reads over 8 different 16-byte
  // bank groups, so neither the cp.async writes nor the ldmatrix reads conflict.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kBlockKSmem == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzleBits, 3, 3>{},
      Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));

  // Global -> shared: 16-byte cp.async per thread; consecutive threads cover one row chunk so a warp
  // reads whole 128-byte lines. The zero-fill form (`.with(false)` reads nothing and writes 16 zero bytes)
  // lets a predicated tile copy stay one instruction per chunk, with no separate shared-memory stores.
  static constexpr int kGmemElemsPerLoad = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  static constexpr int kGmemRowsPerPass = kNThreads / kGmemThreadsPerRow;  // a tile's rows: a multiple of this
  using GmemThreadLayout = Layout<Shape<Int<kGmemRowsPerPass>, Int<kGmemThreadsPerRow>>,
                                  Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{}, GmemThreadLayout{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
  // Shared -> global (outputs): plain 16-byte loads/stores with the same thread arrangement.
  using GmemTiledCopyOut = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{}, GmemThreadLayout{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));

  // Shared -> registers through ldmatrix: plain for operands stored K-major, transposed for V
  // (and for every operand the backward reads along the other dimension).
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  // Registers -> shared for accumulators converted to Element: each thread holds column pairs.
  using SmemCopyAtomOut = Copy_Atom<UniversalCopy<uint32_t>, Element>;
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_, DType kDType,
          bool kUnrollStages_ = false>
struct FwdTraits : BaseTraits<kHeadDim_, kNWarps_, kDType> {
  using Base = BaseTraits<kHeadDim_, kNWarps_, kDType>;
  using typename Base::Element;
  using typename Base::SmemLayoutAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;  // K/V buffers each: 2 lets the next tile load during this one
  static_assert(kStages == 1 || kStages == 2);
  // With 2 stages, unroll the key-block loop by two so each copy of the body reads a fixed buffer (immediate
  // ldmatrix offsets): costs registers, so it is a per-head-dim choice (config.h: kFwdUnrollStages).
  static constexpr bool kUnrollStages = kUnrollStages_;
  static_assert(!kUnrollStages || kStages == 2);
  static_assert(kBlockM % (16 * kNWarps_) == 0, "each warp owns whole 16-row MMA slabs of Q");
  static_assert(kBlockM % Base::kGmemRowsPerPass == 0 && kBlockN % Base::kGmemRowsPerPass == 0,
                "tiles are copied in whole passes of the threads: a partial pass would write rows twice");

  // FA2's work split: warps tile the rows of Q only, so each warp owns complete rows of S and of O
  // and the online softmax never needs another warp. N = 16 per tile so one ldmatrix.x4 feeds two
  // n8 MMAs.
  using TiledMma = TiledMMA<MMA_Atom<typename Base::MmaAtom>, Layout<Shape<Int<kNWarps_>, _1, _1>>,
                            Tile<Int<16 * kNWarps_>, _16, _16>>;

  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V viewed as (head_dim, kBlockN): the B operand of O += P V. Same bytes, no copy.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  // Unswizzled twin of SmemLayoutVt, only to shape the register fragment.
  using SmemLayoutVtShape = decltype(make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{}));

  // O is staged in the bytes of sQ (Q is dead by the epilogue).
  static constexpr int kKVElems = cosize(SmemLayoutKV{});
  static constexpr int kSmemSize = (cosize(SmemLayoutQ{}) + 2 * kStages * kKVElems) * int(sizeof(Element));
};


// Backward: a CTA owns one K/V block (kBlockN keys) and walks the query blocks. Eight warps; each GEMM
// gets its own warp arrangement so every warp has a 32-row-or-wider slab of its output:
//   S = Q K^T, dP = dO V^T   (64 x kBlockN per pass):  2 x 4 warps (4 x 2 for 32-key blocks)
//   dV += P^T dO, dK += dS^T Q (kBlockN x head_dim): 4 x 2 warps (2 x 4 for 64- and 32-key blocks)
//   dQ = dS K                 (kBlockM x head_dim): 2 x 4 warps (4 x 2 for 128-row blocks or head_dim % 64 != 0)
// P and dS go through shared memory: dV and dK need them transposed (ldmatrix.trans reads them back).
// kPdSInV: P and dS take the bytes of V, which is then reloaded for every query block (config.h: the 99 KB
// configuration at d256, where nothing else fits).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, DType kDType, bool kRunningQdO_ = false,
          bool kPdSInV_ = false>
struct BwdTraits : BaseTraits<kHeadDim_, 8, kDType> {
  using Base = BaseTraits<kHeadDim_, 8, kDType>;
  using typename Base::Element;
  using typename Base::MmaAtom;
  using typename Base::SmemLayoutAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static_assert(kBlockN == 32 || kBlockN == 64 || kBlockN == 128);
  static_assert(kBlockM % Base::kGmemRowsPerPass == 0 && kBlockN % Base::kGmemRowsPerPass == 0,
                "tiles are copied in whole passes of the threads: a partial pass would write rows twice");
  static constexpr int kStages = kStages_;  // Q/dO buffers: 2 overlaps the next load with this block's math
  static_assert(kStages == 1 || kStages == 2);
  // Q and dO loaded from running source tiles stepped one block per load, instead of indexed per block: a
  // per-head-dim choice (config.h), as it moves registers.
  static constexpr bool kRunningQdO = kRunningQdO_;
  static constexpr bool kPdSInV = kPdSInV_;

  using Mma2x4 = TiledMMA<MMA_Atom<MmaAtom>, Layout<Shape<_2, _4, _1>>, Tile<_32, _64, _16>>;
  using Mma4x2 = TiledMMA<MMA_Atom<MmaAtom>, Layout<Shape<_4, _2, _1>>, Tile<_64, _32, _16>>;
  // S and dP are computed 64 rows at a time (a 128-row block takes two passes): a 64 x 128 accumulator is
  // what fits in registers beside dK and dV. A 32-key block spreads its 64 x 32 tile over 4 x 2 warps.
  static constexpr int kBlockMSdP = 64;
  static_assert(kBlockM_ % kBlockMSdP == 0);
  using TiledMmaSdP = std::conditional_t<kBlockN_ == 32, Mma4x2, Mma2x4>;
  // With 64- or 32-key blocks, 4 x 2 would give each warp a 16 x head_dim slab that re-reads all of dO^T / Q^T
  // (at 32 keys it would not tile at all; such blocks need head_dim % 64 == 0, which whole copy passes imply).
  using TiledMmadKV = std::conditional_t<kBlockN_ <= 64 && kHeadDim % 64 == 0, Mma2x4, Mma4x2>;
  // 32-row warp slabs read 16 KB of dS/K per warp and tile, 16-row slabs 20 KB (shared memory bandwidth);
  // a 128 x 64 block on 4 x 2 warps reads 16 KB per warp for twice the rows.
  // Blocks of 8192 dQ elements (d64 x 128 rows, d128 x 64 rows) with 128-key blocks: the 8 warps' dQ slabs are
  // contiguous 32 x 32 squares. The permutations put warp (m, n) on rows [32m, 32m + 32) and columns
  // [32n, 32n + 32) instead of interleaved 16-row and 8-column groups, so on sm90 each warp re-tiles its own slab
  // for the atomics (add_dq_to_accum), in 32 KB past the other buffers. The 64-key configurations are those
  // of 99 KB GPUs (config.h), where those 32 KB do not fit.
  static constexpr bool kDqWarpSlabs = kBlockM_ * kHeadDim == 8 * 32 * 32 && kBlockN_ == 128;
  static constexpr int kSlabWarpsM = kBlockM_ / 32, kSlabWarpsN = 8 / kSlabWarpsM;
  using MmadQSlabs = TiledMMA<MMA_Atom<MmaAtom>, Layout<Shape<Int<kSlabWarpsM>, Int<kSlabWarpsN>, _1>>,
                              Tile<Layout<Shape<_16, Int<kSlabWarpsM>, _2>, Stride<_1, _32, _16>>,
                                   Layout<Shape<_8, Int<kSlabWarpsN>, _4>, Stride<_1, _32, _8>>, _16>>;
  using TiledMmadQ = std::conditional_t<kDqWarpSlabs, MmadQSlabs,
                                        std::conditional_t<kHeadDim % 64 == 0 && kBlockM_ == 64, Mma2x4, Mma4x2>>;

  using SmemLayoutQdO = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // P and dS rows are kBlockN long: the 128-byte swizzle, or the 64-byte one for 32-key blocks (as SmemLayoutAtom).
  static constexpr int kBlockNSmem = kBlockN_ >= 64 ? 64 : 32;
  using SmemLayoutAtomPdS = decltype(composition(Swizzle<kBlockNSmem == 64 ? 3 : 2, 3, 3>{},
                                                 Layout<Shape<_8, Int<kBlockNSmem>>, Stride<Int<kBlockNSmem>, _1>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));

  // Transposed views (same bytes) for the operands read along their other dimension.
  template <typename L, int R, int C>
  using Transposed = decltype(composition(L{}, make_layout(Shape<Int<R>, Int<C>>{}, GenRowMajor{})));
  using SmemLayoutPdSt = Transposed<SmemLayoutPdS, kBlockN, kBlockM>;  // (kBlockN, kBlockM)
  using SmemLayoutQdOt = Transposed<SmemLayoutQdO, kHeadDim, kBlockM>;  // (head_dim, kBlockM)
  using SmemLayoutKt = Transposed<SmemLayoutKV, kHeadDim, kBlockN>;     // (head_dim, kBlockN)

  static constexpr int kQdOElems = cosize(SmemLayoutQdO{});
  static constexpr int kKVElems = cosize(SmemLayoutKV{});
  static constexpr int kPdSElems = cosize(SmemLayoutPdS{});
  // P and dS are written after the dP GEMM, the last reader of V in a query block, in one 64-row pass.
  static_assert(!kPdSInV || (kStages == 1 && kBlockM == kBlockMSdP && 2 * kPdSElems <= kKVElems));
  static constexpr int kSmemSize =
      (2 * kStages * kQdOElems + 2 * kKVElems + (kPdSInV ? 0 : 2 * kPdSElems)) * int(sizeof(Element));
  // Extra bytes past kSmemSize for the warps' own dQ slabs, used only by sm90+ device code (config.h:
  // dq_path_for); sm80 code re-tiles in the bytes of sP and sdS instead. The launch adds them where the kernel that
  // runs was compiled for sm90+ (bwd_launch.h), whatever GPU it runs on.
  static constexpr int kDqWarpStageBytes = kDqWarpSlabs ? kBlockM * kHeadDim * int(sizeof(float)) : 0;
};

}  // namespace fa2
