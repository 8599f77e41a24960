// What a Hopper tile's numbers (config.h) imply: the warpgroup MMAs, the shared-memory layouts they read, the TMA
// copies that fill them, the pipelines and the shared storage. The kernel (fwd_kernel.h) is generic over these.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/dtype.h"
#include "sm90/config.h"
#include "sm90/tile_scheduler.h"

namespace fa2::sm90 {
using namespace cute;

// A forward tile as the producer hands it to the consumers: its grid index (>= the tile count: stop), its place and the
// key blocks its rows see, which the producer works out for its loads anyway. The consumers taking the index apart
// again spent ~900 cycles a tile before their first Q K^T (docs/tuning.md#sm90-forward). The sequence's rows stay
// with the consumers (seq_rows): a padded batch's are parameters, which take no register across the loop.
struct FwdWork {
  int index;
  WorkTile w;
  int n_begin, n_end;
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, DType kDType>
struct FwdTraits {
  using Element = std::conditional_t<kDType == DType::fp16, cutlass::half_t, cutlass::bfloat16_t>;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
  static_assert(kBlockM == 64 * kConsumerWarpgroups, "each consumer warpgroup owns 64 query rows");

  // S = Q K^T is (M = query rows, N = keys, K = head dim); O = P V is (M = query rows, N = head dim, K = keys). The
  // consumer warpgroups stack along M. Q and K are K-major (head dim contiguous). V is stored as it comes, (keys, head
  // dim) with the head dim contiguous, which for P V's B operand (N = head dim) is MN-major: wgmma reads it transposed
  // from shared memory, so V needs no transposing copy.
  using AtomLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>>(), AtomLayout{}));
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomLayout{}));
  static constexpr int kConsumerThreads = size(TiledMmaO{});
  static_assert(kConsumerThreads == kConsumerWarpgroups * kWarpgroupThreads);

  // The widest swizzle the tiles allow (128 bytes for these head dims): bank-conflict-free wgmma and TMA.
  template <GMMA::Major kMajor, int kMN, int kK>
  using SmemAtom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<kMajor, Element, Int<kMN>, Int<kK>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockM, kHeadDim>{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockN, kHeadDim>{},
                                             Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V as P V's B operand, (head dim, keys, stages), head dim contiguous. TMA fills it from V seen as (head dim, keys).
  using SmemLayoutVt = decltype(tile_to_shape(SmemAtom<GMMA::Major::MN, kHeadDim, kBlockN>{},
                                              Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  // Global tensors as TMA sees them: (rows, head dim, heads, batch), and V transposed: (head dim, keys, heads, batch).
  // Packed sequences (varlen) have the same four modes, the batch one counting rows (seq_rows.h: tma_rows_view).
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQK = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideVt = Stride<_1, int64_t, int64_t, int64_t>;
  template <class Stride_, class SmemLayout, class Tile>
  using TmaLoad = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                         make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{},
                                                     Stride_{}),
                                         SmemLayout{}, Tile{}, _1{}));
  using TmaQ = TmaLoad<StrideQK, SmemLayoutQ, Shape<Int<kBlockM>, Int<kHeadDim>>>;
  using TmaK = TmaLoad<StrideQK, decltype(take<0, 2>(SmemLayoutK{})), Shape<Int<kBlockN>, Int<kHeadDim>>>;
  using TmaV = TmaLoad<StrideVt, decltype(take<0, 2>(SmemLayoutVt{})), Shape<Int<kHeadDim>, Int<kBlockN>>>;
  // O leaves through shared memory and one TMA store per tile where the bytes fit beside Q, K and V (d64, d128; d256's
  // two 80-key stages fill the 227 KB): the consumers go on to the next tile while the copy engine writes.
  static constexpr bool kStoreByTma = fwd_stores_by_tma(kHeadDim);
  using SmemLayoutO = SmemLayoutQ;
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{},
                                     make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeQKV{}, StrideQK{}),
                                     SmemLayoutO{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  // A TMA load always completes its whole box (rows past the tensor arrive as zeros), so these are the bytes to expect.
  static constexpr uint32_t kBytesQ = size(SmemLayoutQ{}) * sizeof(Element);
  static constexpr uint32_t kBytesK = size(take<0, 2>(SmemLayoutK{})) * sizeof(Element);
  static constexpr uint32_t kBytesV = size(take<0, 2>(SmemLayoutVt{})) * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  // Every tile starts on a 1024-byte boundary: the 128-byte swizzle repeats every 1 KB, and TMA and the wgmma
  // descriptors swizzle on absolute shared-memory address bits.
  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> v;
    cute::array_aligned<Element, kStoreByTma ? cute::cosize_v<SmemLayoutO> : 8, 1024> o;
    alignas(16) cutlass::arch::ClusterTransactionBarrier q_full;  // Q landed (the producer's TMA)
    alignas(16) cutlass::arch::ClusterBarrier q_empty;           // Q read by every Q K^T of the tile (the consumers)
    alignas(16) TileMailbox<FwdWork> tiles;  // the tiles the producer drew, taken apart; the consumers read them
    alignas(16) typename Pipeline::SharedStorage k_pipe;
    alignas(16) typename Pipeline::SharedStorage v_pipe;
  };
  static constexpr int kSmemSize = int(sizeof(SharedStorage));
};

// The kernel's parameters: the TMA descriptors live in the kernel's parameter space (__grid_constant__), where TMA
// reads them; the rest is what the epilogue and the masks need.
template <class Traits>
struct FwdKernelParams {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaO tma_o;  // kStoreByTma
  typename Traits::ShapeQKV shape_q, shape_k;  // (seqlen, head dim, heads, batch); shape_k's heads are nheads_k
  typename Traits::Element* o;
  int64_t o_row_stride, o_head_stride, o_batch_stride;
  float* lse;  // (batch, nheads, seqlen_q); varlen (nheads, total_q)
  int seqlen_q, seqlen_k, nheads, head_group_kv;  // head_group_kv: query heads per K/V head; varlen: the longest
  const int* cu_seqlens_q;  // packed sequences (common/params.h); nullptr: a padded batch
  const int* cu_seqlens_k;
  int total_q, total_k;
  float scale, scale_log2;  // the scores' scale (softmax_scale) and it times log2(e)
  const float* sink;        // (nheads,) logits joining each row's denominator (common/params.h); nullptr: none
  float softcap_in;         // > 0: the scores are tanh(q k^T * softcap_in) (common/params.h), scale being softcap
  int window_left, window_right;  // the band (common/band.h); -1: unbounded; causal is window_right = 0
  const float* alibi_slopes;      // ALiBi's (batch, nheads) or (nheads,) slopes (alibi_batch_stride 0); nullptr: none
  int alibi_batch_stride;
  const int64_t* rng_state;    // dropout's (seed, offset) on the device (common/params.h); nullptr: none
  uint32_t dropout_threshold;  // a score is kept iff its 16 drawn bits are below it
  float dropout_scale;         // 1 / (1 - dropout_p), else 1
  TileScheduler scheduler;  // the tiles and their order
  int* tile_counter;        // tiles handed out past the first gridDim.x, zeroed before the launch; varlen: then
                            // the prefix of query blocks per sequence (fwd_launch.h: varlen_tile_prefix)
};

}  // namespace fa2::sm90
