// The Hopper forward (fa2.reference.flash_fwd_tiled), warp-specialized and persistent: warpgroup 0 draws the tiles
// (tile_scheduler.h) and loads, warpgroups 1 and 2 compute 64 query rows each of a 128-row query block. Key blocks
// go from the last visible one down, so the blocks that need masks come first.       docs/tuning.md#sm90-forward
//
// Names: g* global tiles, s* shared, t*r* register fragments partitioned by an MMA (tSr: of S = Q K^T, tOr: of
// O = P V); m: a query row block, n: a key block.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/band.h"
#include "common/seqlen.h"
#include "sm90/dropout.h"
#include "sm90/seq_rows.h"
#include "sm90/softmax.h"
#include "sm90/tile_scheduler.h"
#include "sm90/traits.h"
#include "sm90/utils.h"

namespace fa2::sm90 {
using namespace cute;

// The key blocks [begin, end) that a query block's rows see (common/band.h's band, bottom-right aligned: row i sees
// key j iff i + diagonal - left <= j <= i + diagonal + right, diagonal = seqlen_k - seqlen_q, -1 unbounded, causal
// being right = 0). end <= begin: no row of the block sees a key.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int2 key_blocks(int m_block, int seqlen_q, int seqlen_k, int left, int right) {
  const int diagonal = seqlen_k - seqlen_q, first_row = m_block * kBlockM, last_row = first_row + kBlockM - 1;
  int begin = 0, end = ceil_div(seqlen_k, kBlockN);
  if (right >= 0) end = min(end, max(ceil_div(last_row + diagonal + right + 1, kBlockN), 0));
  if (left >= 0) begin = max(first_row + diagonal - left, 0) / kBlockN;
  return make_int2(begin, end);
}

constexpr int kEpilogueBarrier = 3;  // the consumer warpgroups' named barrier around the shared O tile

// Ping-pong between the consumer warpgroups: each issues its GEMMs only in its turn (named barrier 1 or 2, beyond
// CUTLASS's reserved ones) and hands the turn over once they are issued, so the tensor cores run one warpgroup's
// GEMMs while the other one's softmax runs on the FP32 units.
struct PingPong {
  int turn, other;  // this warpgroup's barrier and the other one's
  __device__ __forceinline__ explicit PingPong(int consumer) : turn(1 + consumer), other(2 - consumer) {}
  __device__ __forceinline__ void wait() const {
    cutlass::arch::NamedBarrier::sync(2 * kWarpgroupThreads, turn);
  }
  __device__ __forceinline__ void pass() const {
    cutlass::arch::NamedBarrier::arrive(2 * kWarpgroupThreads, other);
  }
  // Warpgroup 1 goes first: it arrives on its own barrier once, which its first wait completes.
  __device__ __forceinline__ void take_first_turn() const {
    cutlass::arch::NamedBarrier::arrive(2 * kWarpgroupThreads, turn);
  }
};

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
  const TileScheduler scheduler = p.scheduler;
  const int num_tiles = scheduler.num_tiles();

  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if constexpr (Traits::kStoreByTma) cute::prefetch_tma_descriptor(p.tma_o.get_tma_descriptor());
    shared.q_full.init(1);
    shared.q_empty.init(Traits::kConsumerThreads);
    shared.tiles.init(Traits::kConsumerThreads);
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
    if (warp != 0 || !cute::elect_one_sync()) return;
    auto shape_vt = make_shape(get<1>(p.shape_k), get<0>(p.shape_k), get<2>(p.shape_k), get<3>(p.shape_k));
    auto k_stage = cutlass::make_producer_start_state<Pipeline>();
    auto v_stage = k_stage;
    int q_loads = 0;
    for (int i = 0, r = blockIdx.x;; ++i) {
      // Draw r is tile r of the grid; varlen: real tile r, whose grid index varlen_tile finds (tile_scheduler.h; the
      // launch wrote the prefix of query blocks after the counter).
      const int t = p.cu_seqlens_q == nullptr ? r : varlen_tile(scheduler, p.tile_counter + 1, r);
      if (t >= num_tiles) {
        shared.tiles.put(i, FwdWork{t});  // past the end: the consumers stop
        break;
      }
      // Take tile t apart, publish it, and draw the next.
      const WorkTile w = scheduler.tile(t);
      const SeqRows seq = seq_rows(p, w.batch);
      const int2 band =
          key_blocks<kBlockM, kBlockN>(w.m_block, seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
      shared.tiles.put(i, FwdWork{t, w, band.x, band.y});
      r = atomicAdd(p.tile_counter, 1) + int(gridDim.x);
      const int head_kv = w.head / p.head_group_kv;
      const int n_begin = band.x, n_end = band.y;
      if (n_end <= n_begin) continue;  // the consumers write this tile's empty rows without loads
      // (rows, d) of this sequence and head; Q's coordinates shifted so that TMA's row bound is the sequence's end.
      Tensor mQ = domain_offset(make_coord(seq.q_shift, _0{}),
                                p.tma_q.get_tma_tensor(p.shape_q)(_, _, w.head, seq.q_coord));
      Tensor mK = p.tma_k.get_tma_tensor(p.shape_k)(_, _, head_kv, seq.k_coord);   // (rows, d)
      Tensor mVt = p.tma_v.get_tma_tensor(shape_vt)(_, _, head_kv, seq.k_coord);  // (d, rows)
      Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.m_block, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      // K and V of the key block whose first row is at row coordinate `row` (k_shift + n * kBlockN for block n). The
      // loops below count in these coordinates, so the shift holds no register of the producer's 24 across them.
      auto load_k = [&](int row) {
        Tensor gK = local_tile(domain_offset(make_coord(row, _0{}), mK), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                               make_coord(_0{}, _0{}));
        auto [tKgK, tKsK] =
            tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        k_pipe.producer_acquire(k_stage);  // waits for the stage to be free, then expects its bytes
        copy(p.tma_k.with(*k_pipe.producer_get_barrier(k_stage), 0, TMA::CacheHintSm90::EVICT_LAST), tKgK,
             tKsK(_, k_stage.index()));
        ++k_stage;
      };
      auto load_v = [&](int row) {
        Tensor gVt = local_tile(domain_offset(make_coord(_0{}, row), mVt), Shape<Int<kHeadDim>, Int<kBlockN>>{},
                                make_coord(_0{}, _0{}));
        auto [tVgV, tVsV] =
            tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sVt), group_modes<0, 2>(gVt));
        v_pipe.producer_acquire(v_stage);
        copy(p.tma_v.with(*v_pipe.producer_get_barrier(v_stage), 0, TMA::CacheHintSm90::EVICT_LAST), tVgV,
             tVsV(_, v_stage.index()));
        ++v_stage;
      };
      // Q waits for the consumers' last Q K^T of the previous tile; K and V may already stream in.
      if (q_loads > 0) shared.q_empty.wait((q_loads - 1) & 1);
      shared.q_full.arrive_and_expect_tx(Traits::kBytesQ);
      copy(p.tma_q.with(reinterpret_cast<uint64_t&>(shared.q_full), 0, TMA::CacheHintSm90::EVICT_FIRST), tQgQ, tQsQ);
      ++q_loads;
      // The order the consumers use them in: K of block n before V of block n + 1 (whose P V runs under Q K_n^T).
      const int row_last = seq.k_shift + (n_end - 1) * kBlockN, row_begin = seq.k_shift + n_begin * kBlockN;
      load_k(row_last);
      for (int row = row_last - kBlockN; row >= row_begin; row -= kBlockN) {
        load_k(row);
        load_v(row + kBlockN);
      }
      load_v(row_begin);
    }
    k_pipe.producer_tail(k_stage);  // no exit while loads into this CTA's shared memory are in flight
    v_pipe.producer_tail(v_stage);
    return;
  }

  // ------------------------------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int thread = threadIdx.x - kWarpgroupThreads;
  const PingPong pingpong(warpgroup - 1);
  typename Traits::TiledMmaS mma_s;
  typename Traits::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(thread);
  auto thr_o = mma_o.get_thread_slice(thread);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // shared-memory descriptors
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (..., stage)
  Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (..., stage)
  // Each register's (row, column) in the S tile and in the O tile, for the masks and the epilogue.
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), rowcol(cS.layout()));
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rc = make_tensor(cO.data(), rowcol(cO.layout()));
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor acc_o = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  constexpr int kRows = decltype(size<0>(acc_o))::value;
  OnlineSoftmax<kRows> softmax;
  const bool dropout = p.rng_state != nullptr;
  DropoutDraw draw(p.rng_state, p.dropout_threshold, p.nheads, 0, 0);  // the seed read once; the head per tile
  typename Traits::PipelineState stage;
  int q_loads = 0;
  if (warpgroup == 1) pingpong.take_first_turn();

  for (int i = 0;; ++i) {
    // Lane 0's copy, broadcast: ptxas then knows the tile warp-uniform and keeps the loop's bookkeeping on the uniform
    // datapath (taken from shared memory as it is, the d64 loop ran 8% slower; docs/tuning.md#sm90-forward).
    const FwdWork tile = warp_uniform(shared.tiles.take(i));
    if (tile.index >= num_tiles) break;
    const WorkTile w = tile.w;
    const SeqRows seq = seq_rows(p, w.batch);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, diagonal = seqlen_k - seqlen_q;
    const int n_begin = tile.n_begin, n_end = tile.n_end;
    const int first_row = w.m_block * kBlockM, last_row = first_row + kBlockM - 1;
    clear(tOrO);
    softmax.reset();
    draw.set_head(p.nheads, w.batch, w.head);

    // The scores' transforms in fa2.reference.attention_ref's order: softcap (a tanh per score), ALiBi (the negated
    // slope in score units times |row + diagonal - key|), then the masks, on the blocks that need them: keys past
    // seqlen_k (TMA brought zeros there), and keys outside a row's band (right of it for causal).
    const int left = p.window_left, right = p.window_right;
    const float alibi =
        p.alibi_slopes == nullptr ? 0.f : -p.alibi_slopes[w.batch * p.alibi_batch_stride + w.head] / p.scale;
    auto finish_scores = [&](auto& s, int n) {
      if (p.softcap_in > 0.f) {
        CUTE_UNROLL
        for (int i = 0; i < size(s); ++i) s(i) = tanh_fast(s(i) * p.softcap_in);
      }
      const int key0 = n * kBlockN;
      if (alibi != 0.f) {
        // A thread's columns are its first one plus constants of the MMA layout: one conversion per row, and per
        // score an FADD of an immediate, the |.| and an FFMA.
        const int col0 = get<1>(cS_rc(0, 0));
        CUTE_UNROLL
        for (int r = 0; r < size<0>(s); ++r) {
          const float distance = float(first_row + get<0>(cS_rc(r, 0)) + diagonal - key0 - col0);
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s); ++c) {
            s(r, c) = fmaf(alibi, fabsf(distance - float(get<1>(cS_rc(r, c)) - col0)), s(r, c));
          }
        }
      }
      if (key0 + kBlockN > seqlen_k || (right >= 0 && key0 + kBlockN - 1 > first_row + diagonal + right) ||
          (left >= 0 && key0 < last_row + diagonal - left)) {
        CUTE_UNROLL
        for (int r = 0; r < size<0>(s); ++r) {
          const int row = first_row + get<0>(cS_rc(r, 0));
          const int key_end = right >= 0 ? min(seqlen_k, row + diagonal + right + 1) : seqlen_k;
          const int key_begin = left >= 0 ? row + diagonal - left : INT_MIN;
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s); ++c) {
            const int key = key0 + get<1>(cS_rc(r, c));
            if (key >= key_end || key < key_begin) s(r, c) = -INFINITY;
          }
        }
      }
    };

    if (n_end > n_begin) {
      shared.q_full.wait(q_loads & 1);
      ++q_loads;
      // The last key block: S alone.
      Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor s = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
      k_pipe.consumer_wait(stage);
      pingpong.wait();
      warpgroup_gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_s, tSrQ, tSrK(_, _, _, stage.index()), tSrS);
      pingpong.pass();
      warpgroup_wait<0>();
      k_pipe.consumer_release(stage);
      finish_scores(s, n_end - 1);
      softmax.template update</*kFirst=*/true>(s, p.scale_log2);
      if (dropout) apply_dropout<kBlockN>(s, cS_rc, draw, first_row, (n_end - 1) * kBlockN);
      // P from registers: the S accumulator converted, relabelled as the A operand of P V.
      Tensor tSrP = make_tensor<Element>(tSrS.layout());
      Tensor tOrP = make_tensor(tSrP.data(), as_operand_a(tSrS.layout()));
      convert(tSrS, tSrP);

      // Each further block: issue S_n = Q K_n^T and O += P_{n+1} V_{n+1}; the softmax of S_n runs under the P V.
      for (int n = n_end - 2; n >= n_begin; --n) {
        auto v_stage = stage;
        ++stage;
        k_pipe.consumer_wait(stage);
        pingpong.wait();
        warpgroup_gemm<true, -1>(mma_s, tSrQ, tSrK(_, _, _, stage.index()), tSrS);
        softmax.rescale_o(acc_o);
        v_pipe.consumer_wait(v_stage);
        warpgroup_gemm<false, -1>(mma_o, tOrP, tOrV(_, _, _, v_stage.index()), tOrO);
        pingpong.pass();
        warpgroup_wait<1>();  // S_n is done; P V may still run
        k_pipe.consumer_release(stage);
        finish_scores(s, n);
        softmax.template update<false>(s, p.scale_log2);
        if (dropout) apply_dropout<kBlockN>(s, cS_rc, draw, first_row, n * kBlockN);  // Philox under the P V too
        warpgroup_wait<0>();
        v_pipe.consumer_release(v_stage);
        convert(tSrS, tSrP);
      }
      // Every Q K^T of the tile has retired: the producer may load the next tile's Q.
      shared.q_empty.arrive();
      // The first key block's P V.
      softmax.rescale_o(acc_o);
      v_pipe.consumer_wait(stage);
      warpgroup_gemm<false, 0>(mma_o, tOrP, tOrV(_, _, _, stage.index()), tOrO);
      v_pipe.consumer_release(stage);
      ++stage;
    }

    // ---------------------------------------------------------------------------------------- epilogue
    float lse[kRows];
    softmax.finalize(acc_o, p.scale, p.sink == nullptr ? nullptr : p.sink + w.head, p.dropout_scale, lse);
    // lse is (batch, nheads, seqlen_q), or packed (nheads, total_q) (common/params.h).
    float* lse_row = p.lse + (p.cu_seqlens_q == nullptr ? (int64_t(w.batch) * p.nheads + w.head) * seqlen_q
                                                        : int64_t(w.head) * p.total_q + seq.q_start);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = first_row + get<0>(cO_rc(r, 0));
      if (row < seqlen_q && get<1>(cO_rc(r, 0)) == 0) lse_row[row] = lse[r];  // one lane of the row's quad
    }
    if constexpr (Traits::kStoreByTma) {
      // O to shared memory (stmatrix), then one TMA store of the tile, which clips the rows past the sequence's end
      // (seq_rows.h: tma_rows_view), so a packed sequence's tile never writes the next sequence's rows. The
      // buffer is rewritten only once the previous tile's store has read it (kEpilogue: both consumer warpgroups).
      Tensor sO = make_tensor(make_smem_ptr(shared.o.data()), typename Traits::SmemLayoutO{});
      Tensor tOrO_out = make_tensor<Element>(tOrO.layout());
      convert(tOrO, tOrO_out);
      auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_o);
      auto thr_copy = smem_copy.get_thread_slice(thread);
      const bool issuer = thread == 0;
      if (issuer) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kEpilogueBarrier);
      copy(smem_copy, thr_copy.retile_S(tOrO_out), thr_copy.partition_D(sO));
      cutlass::arch::fence_view_async_shared();  // the generic-proxy writes, before the copy engine reads them
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kEpilogueBarrier);
      if (issuer) {
        Tensor mO = domain_offset(make_coord(seq.q_shift, _0{}),
                                  p.tma_o.get_tma_tensor(p.shape_q)(_, _, w.head, seq.q_coord));
        Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.m_block, _0{}));
        auto [tOgO, tOsO] = tma_partition(p.tma_o, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sO),
                                          group_modes<0, 2>(gO));
        copy(p.tma_o, tOsO, tOgO);
        tma_store_arrive();
      }
    } else {
      // Packed o has no batch stride (0) and starts the sequence at row q_start.
      Element* o = p.o + w.batch * p.o_batch_stride + int64_t(seq.q_start) * p.o_row_stride + w.head * p.o_head_stride;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = first_row + get<0>(cO_rc(r, 0));
        if (row >= seqlen_q) continue;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(acc_o); c += 2) {  // columns c and c + 1 are adjacent: one 4-byte store
          cutlass::Array<float, 2> pair;
          pair[0] = acc_o(r, c), pair[1] = acc_o(r, c + 1);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(o + row * p.o_row_stride + get<1>(cO_rc(r, c))) =
              cutlass::NumericArrayConverter<Element, float, 2>{}(pair);
        }
      }
    }
  }
  // No exit while a TMA store still reads this CTA's shared memory.
  if constexpr (Traits::kStoreByTma) {
    if (thread == 0) tma_store_wait<0>();
  }
#endif
}

}  // namespace fa2::sm90
