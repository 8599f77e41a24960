// The Hopper forward for one 128-row query block (fa2.reference.flash_fwd_tiled), warp-specialized: warpgroup 0
// loads, warpgroups 1 and 2 compute 64 rows each. Key blocks go from the last visible one down, so the blocks that
// need masks come first.
//
// Names: g* global tiles, s* shared, t*r* register fragments partitioned by an MMA (tSr: of S = Q K^T, tOr: of
// O = P V); m: a query row block, n: a key block.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "sm90/softmax.h"
#include "sm90/traits.h"
#include "sm90/utils.h"

namespace fa2::sm90 {
using namespace cute;

// The key blocks [0, end) that a query block's rows see: all of seqlen_k, or up to the causal diagonal of its last
// row (bottom-right aligned: row i sees keys j <= i + seqlen_k - seqlen_q).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int key_blocks_end(int m_block, int seqlen_q, int seqlen_k, bool causal) {
  int end = ceil_div(seqlen_k, kBlockN);
  if (causal) end = min(end, max(ceil_div((m_block + 1) * kBlockM + seqlen_k - seqlen_q, kBlockN), 0));
  return end;
}

template <class Traits>
__global__ void __launch_bounds__(kThreads, 1) fwd_kernel(CUTE_GRID_CONSTANT FwdKernelParams<Traits> const p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  extern __shared__ __align__(1024) char smem[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = cutlass::canonical_warp_group_idx();
  // Causal grids go heaviest block first: the last query blocks see the most keys.
  const int m_block = p.causal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int head = blockIdx.y, batch = blockIdx.z, head_kv = head / p.head_group_kv;
  const int n_end = key_blocks_end<kBlockM, kBlockN>(m_block, p.seqlen_q, p.seqlen_k, p.causal);

  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    shared.q_full.init(1);
  }
  // K and V have a pipeline each (a stage is released once the GEMM that reads it has retired), advanced together.
  typename Pipeline::Params pipe_params;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kConsumerThreads;
  pipe_params.transaction_bytes = Traits::kBytesK;
  Pipeline k_pipe(shared.k_pipe, pipe_params, Shape<_1, _1, _1>{});
  pipe_params.transaction_bytes = Traits::kBytesV;
  Pipeline v_pipe(shared.v_pipe, pipe_params, Shape<_1, _1, _1>{});
  __syncthreads();  // the barriers are initialised before anyone waits on them

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutVt{});

  if (warpgroup == 0) {
    // ------------------------------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<24>();  // the loads need few registers; the consumers get them
    if (warp != 0 || !cute::elect_one_sync() || n_end <= 0) return;
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q)(_, _, head, batch);                             // (seqlen_q, d)
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_k)(_, _, head_kv, batch);                          // (seqlen_k, d)
    auto shape_vt = make_shape(get<1>(p.shape_k), get<0>(p.shape_k), get<2>(p.shape_k), get<3>(p.shape_k));
    Tensor mVt = p.tma_v.get_tma_tensor(shape_vt)(_, _, head_kv, batch);                          // (d, seqlen_k)
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));        // (N, d, n)
    Tensor gVt = local_tile(mVt, Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(_0{}, _));      // (d, N, n)
    auto [tQgQ, tQsQ] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sVt),
                                      group_modes<0, 2>(gVt));
    shared.q_full.arrive_and_expect_tx(Traits::kBytesQ);
    copy(p.tma_q.with(reinterpret_cast<uint64_t&>(shared.q_full), 0, TMA::CacheHintSm90::EVICT_FIRST), tQgQ, tQsQ);
    auto stage = cutlass::make_producer_start_state<Pipeline>();
    for (int n = n_end - 1; n >= 0; --n, ++stage) {
      k_pipe.producer_acquire(stage);  // waits for the stage to be free, then expects its bytes
      copy(p.tma_k.with(*k_pipe.producer_get_barrier(stage), 0, TMA::CacheHintSm90::EVICT_LAST), tKgK(_, n),
           tKsK(_, stage.index()));
      v_pipe.producer_acquire(stage);
      copy(p.tma_v.with(*v_pipe.producer_get_barrier(stage), 0, TMA::CacheHintSm90::EVICT_LAST), tVgV(_, n),
           tVsV(_, stage.index()));
    }
    k_pipe.producer_tail(stage);  // no exit while loads into this CTA's shared memory are in flight
    v_pipe.producer_tail(stage);
    return;
  }

  // ------------------------------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int thread = threadIdx.x - kWarpgroupThreads;
  typename Traits::TiledMmaS mma_s;
  typename Traits::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(thread);
  auto thr_o = mma_o.get_thread_slice(thread);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // shared-memory descriptors
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (..., stage)
  Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (..., stage)
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor acc_o = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  // Each register's (row, column) in the S tile and in the O tile, for the masks and the epilogue.
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), rowcol(cS.layout()));
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rc = make_tensor(cO.data(), rowcol(cO.layout()));
  constexpr int kRows = decltype(size<0>(acc_o))::value;
  OnlineSoftmax<kRows> softmax;
  clear(tOrO);

  const int diagonal = p.seqlen_k - p.seqlen_q;
  const int first_row = m_block * kBlockM;
  typename Traits::PipelineState stage;
  if (n_end > 0) shared.q_full.wait(0);
  for (int n = n_end - 1; n >= 0; --n, ++stage) {
    // S = Q K^T for this key block.
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    k_pipe.consumer_wait(stage);
    warpgroup_gemm</*kZeroInit=*/true, /*kWait=*/0>(mma_s, tSrQ, tSrK(_, _, _, stage.index()), tSrS);
    k_pipe.consumer_release(stage);
    Tensor s = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
    // Masks: keys past seqlen_k (TMA brought zeros there), and for causal keys right of a row's diagonal.
    const int key0 = n * kBlockN;
    if (key0 + kBlockN > p.seqlen_k || (p.causal && key0 + kBlockN - 1 > first_row + diagonal)) {
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s); ++r) {
        const int key_end = min(p.seqlen_k, p.causal ? first_row + get<0>(cS_rc(r, 0)) + diagonal + 1 : p.seqlen_k);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); ++c) {
          if (key0 + get<1>(cS_rc(r, c)) >= key_end) s(r, c) = -INFINITY;
        }
      }
    }
    if (n == n_end - 1) {
      softmax.template update</*kFirst=*/true>(s, acc_o, p.scale_log2);
    } else {
      softmax.template update</*kFirst=*/false>(s, acc_o, p.scale_log2);
    }
    // O += P V, P from registers: the S accumulator converted, relabelled as the A operand.
    Tensor tSrP = convert<Element>(tSrS);
    Tensor tOrP = make_tensor(tSrP.data(), as_operand_a(tSrS.layout()));
    v_pipe.consumer_wait(stage);
    warpgroup_gemm</*kZeroInit=*/false, /*kWait=*/0>(mma_o, tOrP, tOrV(_, _, _, stage.index()), tOrO);
    v_pipe.consumer_release(stage);
  }

  // ------------------------------------------------------------------------------------------ epilogue
  float lse[kRows];
  softmax.finalize(acc_o, p.scale, lse);
  Element* o = p.o + batch * p.o_batch_stride + head * p.o_head_stride;
  float* lse_row = p.lse + (int64_t(batch) * p.nheads + head) * p.seqlen_q;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = first_row + get<0>(cO_rc(r, 0));
    if (row >= p.seqlen_q) continue;
    if (get<1>(cO_rc(r, 0)) == 0) lse_row[row] = lse[r];  // one lane of the row's quad
    CUTE_UNROLL
    for (int c = 0; c < size<1>(acc_o); c += 2) {  // columns c and c + 1 are adjacent: one 4-byte store
      cutlass::Array<float, 2> pair;
      pair[0] = acc_o(r, c), pair[1] = acc_o(r, c + 1);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(o + row * p.o_row_stride + get<1>(cO_rc(r, c))) =
          cutlass::NumericArrayConverter<Element, float, 2>{}(pair);
    }
  }
#endif
}

}  // namespace fa2::sm90
