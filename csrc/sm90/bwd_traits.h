// What a Hopper backward tile's numbers (config.h: bwd_tile) imply: the five warpgroup MMAs, the shared-memory layouts
// they read (and the transposed views of the same bytes), the TMA loads, the pipelines and the shared storage. The
// kernel (bwd_kernel.h) is generic over these.                                            docs/tuning.md#sm90-backward
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/dtype.h"
#include "common/schedule.h"
#include "sm90/config.h"
#include "sm90/tile_scheduler.h"

namespace fa2::sm90 {
using namespace cute;

constexpr int kBwdMmaWarpgroups = 2;
constexpr int kBwdThreads = (1 + kBwdMmaWarpgroups) * kWarpgroupThreads;

// d64 and d128: FA3's d128 structure (its SdP_swapAB, Mma_dKV_is_RS). S and dP are computed transposed, rows = keys,
// so that P^T and dS^T are already the register A operands of dV += P^T dO and dK += dS^T Q, and P never touches
// shared memory. The two MMA warpgroups stack on the keys for S^T, dP^T, dV and dK (64 keys each) and on the head dim
// for dQ.
// d256 (kWide): FA3's d256 structure (its dKV_swapAB; config.h says why). S and dP as they are, the warpgroups
// side by side on the keys (32 each); dV^T += dO^T P and dK^T += Q^T dS with both operands from shared memory, the
// warpgroups stacked on the head dim (warpgroup w: dims 64w + [0, 64) and 128 + 64w + [0, 64)); dQ per 128-column
// half.
// dV and dK's wgmma: narrow (M = keys, N = d, K = queries), A from registers; wide (M = d, N = keys), both from
// shared memory. A function, so that only the chosen selector is instantiated (each asserts its own shapes).
template <bool kWide, class Element, class M, class N, class D>
constexpr auto bwd_dkv_op() {
  if constexpr (kWide) {
    return GMMA::ss_op_selector<Element, Element, float, Shape<D, N, M>, GMMA::Major::MN, GMMA::Major::MN>();
  } else {
    return GMMA::rs_op_selector<Element, Element, float, Shape<N, D, M>, GMMA::Major::K, GMMA::Major::MN>();
  }
}

// dQ's wgmma: dQ = dS K (M = queries, N = head dim, K = keys), dS K-major and K^T MN-major; or swapped, dQ^T = K^T
// dS^T (M = head dim, N = queries), where the queries are no multiple of wgmma's M (80): the same two tiles, with K^T
// the A operand and dS the B. Per warpgroup: Cols columns of dQ (rows of dQ^T).
template <bool kSwap, class Element, class M, class Cols, class N>
constexpr auto bwd_dq_op() {
  if constexpr (kSwap) {
    return GMMA::ss_op_selector<Element, Element, float, Shape<Cols, M, N>, GMMA::Major::MN, GMMA::Major::K>();
  } else {
    return GMMA::ss_op_selector<Element, Element, float, Shape<M, Cols, N>, GMMA::Major::K, GMMA::Major::MN>();
  }
}

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, DType kDType>
struct BwdTraits {
  using Element = std::conditional_t<kDType == DType::fp16, cutlass::half_t, cutlass::bfloat16_t>;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr bool kWide = kHeadDim == 256;
  static constexpr int kStagesdO = bwd_do_stages({kHeadDim, kBlockM, kBlockN, kStages, false, false});
  static constexpr int kStagesdS = kWide ? 2 : kStages;  // narrow: one per Q stage; wide: dS (0) and P (1)
  static constexpr int kdQCols = kWide ? 128 : kHeadDim;  // columns of one dQ GEMM
  static constexpr bool kdQSwapAB = !kWide && kBlockM % 64 != 0;  // dQ^T = K^T dS^T (bwd_dq_op)
  static constexpr bool kPersistent = bwd_persistent({kHeadDim, kBlockM, kBlockN, kStages, false, false});
  static constexpr bool kPacks = bwd_tile_packs({kHeadDim, kBlockM, kBlockN, kStages, false, false});
  static constexpr bool kdKVByTma = bwd_stores_dkv_by_tma({kHeadDim, kBlockM, kBlockN, kStages, false, false});
  static constexpr bool kUniformDescriptors =
      bwd_uniform_descriptors({kHeadDim, kBlockM, kBlockN, kStages, false, false});
  // setmaxnreg's split of the CTA's pool, 168 x 384 at launch, between the producer warpgroup (the loads, the dQ
  // writer) and the MMA warpgroups: 40 / 232 is exact (24 / 240 spilled 44 B in the producer once it also loaded lse
  // and D; 32 / 240 would ask for more than the pool holds). 80 queries: S^T, dP^T, dK and dV are 208 fp32 a thread,
  // and at 232 ptxas serialized the wgmmas (its C7512) and spilled S^T across dP^T's GEMM: 24 / 240, FA3's split.
  static constexpr int kProducerRegs = kdQSwapAB ? 24 : 40, kMmaRegs = kdQSwapAB ? 240 : 232;
  static constexpr int kMmaThreads = kBwdMmaWarpgroups * kWarpgroupThreads;
  static_assert(kWide ? kBlockN == 64 : kBlockN == 64 * kBwdMmaWarpgroups,
                "narrow: each MMA warpgroup owns 64 keys; wide: 32 keys of S, 2 x 64 fp32 of dK^T and dV^T");
  using M = Int<kBlockM>;
  using N = Int<kBlockN>;
  using D = Int<kHeadDim>;

  // S^T = K Q^T and dP^T = V dO^T: (M = keys, N = queries, K = head dim), both operands K-major in shared memory.
  // Wide: S = Q K^T and dP = dO V^T, (M = queries, N = keys, K = head dim).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           std::conditional_t<kWide, Shape<M, Int<kBlockN / kBwdMmaWarpgroups>, D>, Shape<N, M, D>>>(),
      std::conditional_t<kWide, Layout<Shape<_1, Int<kBwdMmaWarpgroups>, _1>>,
                         Layout<Shape<Int<kBwdMmaWarpgroups>, _1, _1>>>{}));
  // dV += P^T dO and dK += dS^T Q: (M = keys, N = head dim, K = queries). A from registers must be K-major; B is dO
  // (or Q) read as (head dim, queries) with the head dim contiguous, i.e. MN-major: no transposing copy.
  // Wide: dV^T += dO^T P and dK^T += Q^T dS, (M = head dim, N = keys, K = queries), both transposed views (MN-major).
  using TiledMmadKV = decltype(make_tiled_mma(bwd_dkv_op<kWide, Element, M, N, D>(),
                                              Layout<Shape<Int<kBwdMmaWarpgroups>, _1, _1>>{}));
  // dQ = dS K: (M = queries, N = head dim, K = keys); the warpgroups split the head dim (64 queries are one wgmma M).
  // Wide: one 128-column half at a time. Swapped (80 queries): dQ^T = K^T dS^T, (M = head dim, N = queries, K = keys),
  // the warpgroups stacked on M, so each still owns the same 64 columns of dQ.
  using dQShape = std::conditional_t<kdQSwapAB, Shape<D, M>, Shape<M, Int<kdQCols>>>;  // the GEMM's (M, N)
  using TiledMmadQ = decltype(make_tiled_mma(
      bwd_dq_op<kdQSwapAB, Element, M, Int<kdQCols / kBwdMmaWarpgroups>, N>(),
      std::conditional_t<kdQSwapAB, Layout<Shape<Int<kBwdMmaWarpgroups>, _1, _1>>,
                         Layout<Shape<_1, Int<kBwdMmaWarpgroups>, _1>>>{}));
  static_assert(size(TiledMmaSdP{}) == kMmaThreads && size(TiledMmadKV{}) == kMmaThreads &&
                size(TiledMmadQ{}) == kMmaThreads);

  // Shared memory. Each tile is stored once and read both ways: a swizzle atom's K extent is the slice of the other
  // dimension one warpgroup's transposed read covers (Q, dO: the whole head dim of dK/dV; K: half the head dim, dQ's
  // per-warpgroup N), so each transposed view is a whole number of swizzle atoms, which wgmma needs.
  template <GMMA::Major kMajor, int kMN, int kK>
  using SmemAtom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<kMajor, Element, Int<kMN>, Int<kK>>());
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockM, kHeadDim>{}, Shape<M, D, Int<kStages>>{}));
  using SmemLayoutdO =
      decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockM, kHeadDim>{}, Shape<M, D, Int<kStagesdO>>{}));
  using SmemLayoutK =
      decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockN, kHeadDim / kBwdMmaWarpgroups>{}, Shape<N, D>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockN, kHeadDim>{}, Shape<N, D>{}));
  // dS as dQ's A operand, (queries, keys) with the keys contiguous; one stage per Q stage (wide: dS, then P in the
  // same layout). Wide: every read (dQ's A, dK^T's and dV^T's B) spans all the keys, so the atom does.
  using SmemLayoutdS = decltype(tile_to_shape(
      SmemAtom<GMMA::Major::K, kBlockM, kWide ? kBlockN : kBlockN / kBwdMmaWarpgroups>{}, Shape<M, N, Int<kStagesdS>>{},
      Step<_1, _2, _3>{}));
  // Transposed views, Xt(c, r, s) = X(r, c, s): a composition with the (cols, rows) -> row + rows * col layout.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<D, M, Int<kStages>>{}, Stride<M, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_layout(Shape<D, M, Int<kStagesdO>>{}, Stride<M, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{}, make_layout(Shape<D, N>{}, Stride<N, _1>{})));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<N, M, Int<kStagesdS>>{}, Stride<M, _1, Int<kBlockM * kBlockN>>{})));
  // The registers hold dS^T (keys, queries) and shared memory wants dS (queries, keys): stmatrix's transposing form.
  // Wide: the registers hold P and dS as stored, 16 a thread (x2: 8 x 8 matrices of 16 rows x 8 keys per warp).
  using SmemCopyAtomdS =
      Copy_Atom<std::conditional_t<kWide, SM90_U32x2_STSM_N, SM90_U16x8_STSM_T>, Element>;

  // Global tensors as TMA sees them: (rows, head dim, heads, batch), the head dim contiguous.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  template <class SmemLayout, class Tile>
  using TmaLoad = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                         make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{},
                                                     StrideQKV{}),
                                         SmemLayout{}, Tile{}, _1{}));
  using TmaQ = TmaLoad<decltype(take<0, 2>(SmemLayoutQ{})), Shape<M, D>>;  // also dO's
  using TmaK = TmaLoad<SmemLayoutK, Shape<N, D>>;
  using TmaV = TmaLoad<SmemLayoutV, Shape<N, D>>;
  // dK from K's shared memory and dV from V's, in their layouts (kdKVByTma).
  template <class SmemLayout>
  using TmaStore = decltype(make_tma_copy(SM90_TMA_STORE{},
                                          make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeQKV{},
                                                      StrideQKV{}),
                                          SmemLayout{}, Shape<N, D>{}, _1{}));
  // lse and D of a query block by a rank-1 TMA over the whole flat (batch, heads, seqlen_q) buffer, so fa2's
  // unpadded statistics need no padded copy. A box must start on 16 bytes (reported for TMA, not documented): it
  // starts at the head's first row rounded down to 4 floats and is 4 floats longer, the block's kBlockM floats inside
  // it at offset (first row & 3). Floats of other heads' rows, or zeros past the buffer, are masked by the MMA warps.
  using ShapeStats = Shape<int32_t>;
  static constexpr int kStatsBox = kBlockM + 4, kStatsStage = (kStatsBox + 31) / 32 * 32;  // a stage: 128-byte aligned
  using StatsBox = Int<kStatsBox>;
  using TmaStats = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                          make_tensor(make_gmem_ptr(static_cast<float const*>(nullptr)), ShapeStats{},
                                                      Stride<_1>{}),
                                          Layout<StatsBox>{}, StatsBox{}, _1{}));
  // dQ of a query block (wide: of one 128-column half), staged (bwd_dq_stage.h) for the writer warp's TMA reduce-add
  // into the row-major fp32 dq_accum: (M, kdQCols), 128-byte swizzle (8 x 32-float atoms); MMA warpgroup w's slab,
  // columns [64w, 64w + 64) of the GEMM's, is the first or second half.
  using dQSlab = Shape<M, Int<kdQCols / kBwdMmaWarpgroups>>;
  using SmemLayoutdQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, Shape<M, Int<kdQCols>>{}));
  using SmemLayoutdQt =  // dQ^T's
      decltype(composition(SmemLayoutdQ{}, make_layout(Shape<Int<kdQCols>, M>{}, Stride<M, _1>{})));
  using SmemLayoutdQSlab = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, dQSlab{}));
  using TmadQ = decltype(make_tma_copy(SM90_TMA_REDUCE_ADD{},
                                       make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)), ShapeQKV{},
                                                   StrideQKV{}),
                                       SmemLayoutdQSlab{}, dQSlab{}, _1{}));

  // A TMA load completes its whole box (rows past the tensor arrive as zeros): these are the bytes to expect, Q's
  // (or dO's) tile and lse's (or D's) block on the same barrier.
  static constexpr uint32_t kBytesQ = size(take<0, 2>(SmemLayoutQ{})) * sizeof(Element) + kStatsBox * sizeof(float);
  static constexpr uint32_t kBytesKV = 2 * size(SmemLayoutK{}) * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;  // Q's; dO's too where they have as many stages
  using PipelineState = cutlass::PipelineState<kStages>;
  using PipelinedO = cutlass::PipelineTmaAsync<kStagesdO>;
  using PipelineStatedO = cutlass::PipelineState<kStagesdO>;

  // Every tile on a 1024-byte boundary: the 128-byte swizzle repeats every 1 KB, and TMA and the wgmma descriptors
  // swizzle on absolute shared-memory address bits.
  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdO>, 1024> dO;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdS>, 1024> dS;  // wide: and P
    cute::array_aligned<float, cute::cosize_v<SmemLayoutdQ>, 1024> dq;
    cute::array_aligned<float, kStatsStage * kStages, 128> lse;  // a box per stage, with Q's stages
    cute::array_aligned<float, kStatsStage * kStagesdO, 128> d;  // a box per stage, with dO's stages
    alignas(16) cutlass::arch::ClusterTransactionBarrier kv_full;  // K and V landed
    alignas(16) cutlass::arch::ClusterBarrier kv_empty;  // a tile's last GEMM that reads K and V retired (persistent)
    // The tiles a persistent CTA's producer drew (tile_scheduler.h); the MMA warpgroups and the dQ writer read them.
    alignas(16) TileMailbox<> tiles;
    alignas(16) typename Pipeline::SharedStorage q_pipe;
    alignas(16) typename PipelinedO::SharedStorage do_pipe;
    int ticket;  // deterministic mode: this CTA's place in the order (bwd_kernel.h)
  };
  static constexpr int kSmemSize = int(sizeof(SharedStorage));
};

// The kernel's parameters: TMA descriptors in the kernel's parameter space (__grid_constant__), where TMA reads them;
// the rest is what the statistics, the masks and the dK/dV epilogue need.
template <class Traits>
struct BwdKernelParams {
  typename Traits::TmaQ tma_q, tma_do;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaStats tma_lse, tma_d;  // over lse and d_sum, flat
  typename Traits::TmadQ tma_dq;             // reduce-add into dq_accum (the writer's)
  // dK and dV as (rows, head dim, heads, batch) where the tile stores them by TMA (kdKVByTma) and dkv_tma says their
  // buffers allow it; otherwise unset, and the MMA threads store them from registers.
  typename Traits::template TmaStore<typename Traits::SmemLayoutK> tma_dk;
  typename Traits::template TmaStore<typename Traits::SmemLayoutV> tma_dv;
  bool dkv_tma;
  // (rows, head dim, heads, batch); shape_k's heads are nheads_k. Packed sequences (varlen): (max_seqlen, head dim,
  // heads, total + 1), addressed through seq_rows.h (tma_rows_view, seq_rows).
  typename Traits::ShapeQKV shape_q, shape_k;
  int32_t stats_total;  // lse's and d_sum's length: batch * nheads * seqlen_q, or nheads * total_q (lse: natural log,
                        // -inf: no key seen; d_sum: D = rowsum(dO * O), which the preprocess writes)
  int stats_head_rows;  // from one head's statistics to the next one's: seqlen_q, or total_q (packed)
  void* dk;  // (batch, seqlen_k, nheads / walk_heads, head dim), packed (total_k, ...): one slice per walk, Element,
  void* dv;  // or fp32 (dkv_fp32) where a K/V group has several walks, which the host sums
  int64_t dk_row_stride, dk_head_stride, dk_batch_stride;  // packed: no batch stride (0), rows from the sequence's
  int64_t dv_row_stride, dv_head_stride, dv_batch_stride;  // first key
  bool dkv_fp32;
  int seqlen_q, seqlen_k, nheads, head_group_kv;  // head_group_kv: query heads per K/V head; packed: the max lengths
  const int* cu_seqlens_q;  // packed sequences (varlen; common/params.h), else null
  const int* cu_seqlens_k;
  int total_q, total_k;
  int walk_heads;  // query heads a tile walks (of one K/V group; bwd_kernel.h: BwdWork), summing dK and dV in registers
  int tile_heads;  // nheads / walk_heads
  float scale_log2;     // softmax_scale * log2(e)
  float softmax_scale;  // dK's and dQ's scale
  bool causal;
  int head_group;  // causal: key blocks go heaviest first within groups of walks (common/schedule.h); 0: grid order
  int* dq_semaphore;  // deterministic: (query block, batch, head) -> key blocks whose dQ share is in, then the tickets
  int m_blocks;       // query blocks per head
  int n_blocks, batch;  // the tiles: n_blocks x tile_heads x batch, key blocks fastest (bwd_kernel.h: bwd_work)
  int* tile_counter;    // persistent launch: the tiles handed out, every one drawn from it (zeroed before); else null
  bool dq_rotate;     // deterministic full attention: key block n walks from query block n mod m_blocks (bwd_kernel.h)
  // Persistent tiles: dQ converted in the kernel (bwd_dq_convert.h). dq_done: (query block, batch, head) -> the key
  // blocks whose share is complete in dq_accum (zeroed before the launch); null where the convert kernel runs after.
  int* dq_done;
  const float* dq_accum;
  void* dq;  // (batch, seqlen_q, nheads, head dim), Element; packed (total_q, ...) without a batch stride
  int64_t dq_row_stride, dq_head_stride, dq_batch_stride;
};

}  // namespace fa2::sm90
