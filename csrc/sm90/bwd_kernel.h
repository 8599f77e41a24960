// The Hopper backward (fa2.reference.flash_bwd_tiled's inner loop, KV-stationary), warp-specialized. A tile is a
// (key block, walk, batch), a walk being the query heads of one K/V head that the tile visits in turn (GQA/MQA: its
// whole group where the plan finds enough tiles, host/plan.cpp; MHA: one head); a persistent CTA per SM takes them one
// after another from a counter (config.h: bwd_persistent: d64, d128's causal tile), or one CTA per tile runs (the
// other tiles, deterministic mode). Warp 0 of warpgroup 0 draws the tiles, loads each tile's K and V once and streams
// Q and dO (with lse and D) of every query block of the walk's heads that sees those keys through TMA rings;
// warpgroups 1 and 2 own 64 keys each, keep dK and dV in registers for the whole stream (so a group's sum costs no
// memory traffic), and stage each query block's dQ share in shared memory, which warp 1 of warpgroup 0 adds into the
// fp32 dq_accum by TMA reduce-add; in persistent launches warps 2 and 3 convert each query block's sums to dQ once
// they are complete (bwd_dq_convert.h). The next tile's first Q and dO land while this one ends, and its K and V once
// this one's dK and dV have left through their memory (config.h: bwd_stores_dkv_by_tma), or its last GEMM that reads
// them retired. d256 keeps the prologue, the producer and the writer (which takes its dQ per 128-column half); its MMA
// warpgroups are bwd_mma_wide.h's.
//                                                                                      docs/tuning.md#sm90-backward
//
// Names: g* global tiles, s* shared (s*t: the transposed view of the same bytes), t*r* register fragments partitioned
// by an MMA (tSr: of S^T = K Q^T, tdPr: of dP^T = V dO^T, tdVr / tdKr: of dV, dK, tdQr: of dQ = dS K, or of
// dQ^T = K^T dS^T where the traits swap it); m: a query block, n: a key block. Statistics per query: lse (natural
// log, the forward's), D = rowsum(dO * O) (the preprocess's).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "sm90/bwd_dq_convert.h"
#include "sm90/bwd_dq_stage.h"
#include "sm90/bwd_mma_wide.h"
#include "sm90/bwd_traits.h"
#include "sm90/seq_rows.h"
#include "sm90/tile_scheduler.h"
#include "sm90/utils.h"

namespace fa2::sm90 {
using namespace cute;

// An accumulator whose M is keys and N queries (S^T, dP^T) as (rows = queries, cols = keys): utils.h's rowcol with
// the modes swapped, so that a row's statistic (lse, D) is one value per row as in the reference.
template <class Layout>
__device__ __forceinline__ auto rowcol_t(Layout const& l) {
  return make_layout(make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)), make_layout(get<0, 1>(l), get<1>(l)));
}

// The MMA warpgroups' named barrier: dS complete in shared memory (each warpgroup wrote its 64 keys; dQ = dS K reads
// all of them). Id 0 past CUTLASS's reserved ones.
constexpr int kdSBarrier = 0;

// An operand of dQ's GEMM, as its A or its B: dS is A and K^T B, or the other way round where the traits swap the GEMM
// (dQ^T = K^T dS^T).
template <bool kA, class ThrMma, class SmemTensor>
__device__ __forceinline__ auto partition_fragment_ab(ThrMma const& thr, SmemTensor const& t) {
  if constexpr (kA) {
    return thr.partition_fragment_A(t);
  } else {
    return thr.partition_fragment_B(t);
  }
}

// Deterministic mode's turns (one lane each): a key block adds its dQ share of a query block once the semaphore says
// the key blocks before it in the turn order have, then passes the turn on once its adds are complete in global
// memory. The key blocks that visit query block m are [0, n_vis(m)) (causal blocks start later in the queries, never
// earlier). Full attention: turns in key-block order, or with rotated walks (p.dq_rotate) in the order the key blocks
// reach m (common/schedule.h RotatedTurns). Causal: from the last visitor down (FA3's order), with the
// lightest key blocks dispatched first, so a CTA only waits for blocks that started before it at later queries and
// are ahead of it; in key-block order every CTA of a head would trail key block 0 to the end.
__device__ __forceinline__ void wait_for_turn(const int* semaphore, int turn) {
  int seen;
  while (true) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(semaphore) : "memory");
    if (seen == turn) break;
    __nanosleep(64);  // fewer polls of the line the adder is about to release
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");  // the TMA adds that follow come after the acquire
}

__device__ __forceinline__ void pass_turn(int* semaphore) {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the adds done, not only their reads of the slab
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(semaphore) : "memory");
}

// What the tile at (x, y, batch) of the dispatch order covers: blockIdx in a grid of one CTA per tile, or tile t of a
// persistent CTA taken apart as blockIdx would be (key blocks fastest, then walks, then batch entries): the CTAs
// running together read one head's Q and dO (L2 hits), a walk's heads one after another. Causal: key block 0 (seen
// by every query) is the heaviest; the heaviest blocks of a group of walks go first, except in deterministic mode,
// where the lightest go first (the turn order above). Bottom-right aligned per sequence (seq: seq_rows.h): query i
// sees key j iff j <= i + diagonal (causal); the query blocks that see a key of the block are [m_begin, m_end). A
// padded batch's every key sees some query, so that range is never empty there; the code still writes dK = dV = 0
// for an empty one (a packed sequence's keys without queries). A packed sequence's key blocks past its end have none.
// Per head, the tile visits m_end - m_begin blocks from m_first, wrapping from m_end to m_begin. Deterministic full
// attention (p.dq_rotate) starts key block n at m_begin + n mod the count, so a head's CTAs add into different query
// blocks at each step instead of queueing behind key block 0; otherwise m_first = m_begin. The walk's heads (from
// `head`, its first) take that order in turn: `steps` query blocks in all. The producer, both MMA warpgroups and the
// dQ writer visit the same order; the pipeline stages follow it.
struct BwdWork {
  int n_block, head, batch, m_begin, m_end, m_first, steps;
  __device__ __forceinline__ int next(int m) const { return m + 1 == m_end ? m_begin : m + 1; }
  // After next(m): the walk has come round to the next head.
  __device__ __forceinline__ bool new_head(int m) const { return m == m_first; }
};

template <int kBlockM, int kBlockN, bool kPacks, class Params>
__device__ __forceinline__ BwdWork bwd_work(Params const& p, int x, int y, int batch) {
  const bool lightest_first = p.dq_semaphore != nullptr && p.causal;
  const BlockHead b = lightest_first ? scheduled_block</*kHeavyLast=*/true>(max(p.head_group, 1), x, y, p.n_blocks)
                                     : scheduled_block</*kHeavyLast=*/false>(p.head_group, x, y, p.n_blocks);
  const SeqRows seq = seq_rows<kPacks>(p, batch);
  const int diagonal = seq.seqlen_k - seq.seqlen_q;
  const int m_begin = p.causal ? max(b.block * kBlockN - diagonal, 0) / kBlockM : 0;
  const int m_end = b.block * kBlockN < seq.seqlen_k ? ceil_div(seq.seqlen_q, kBlockM) : 0, m_count = m_end - m_begin;
  const int m_first = p.dq_rotate && m_count > 0 ? m_begin + b.block % m_count : m_begin;
  return {b.block, b.head * p.walk_heads, batch, m_begin, m_end, m_first, max(m_count, 0) * p.walk_heads};
}

template <class Traits>
__global__ void __launch_bounds__(kBwdThreads, 1) bwd_kernel(CUTE_GRID_CONSTANT BwdKernelParams<Traits> const p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelinedO = typename Traits::PipelinedO;
  using M = typename Traits::M;
  using N = typename Traits::N;
  using D = typename Traits::D;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr bool kdQSwapAB = Traits::kdQSwapAB;
  extern __shared__ __align__(1024) char smem[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = cutlass::canonical_warp_group_idx();
  constexpr bool kPersistent = Traits::kPersistent, kPacks = Traits::kPacks;
  const int num_tiles = p.n_blocks * p.tile_heads * p.batch;
  constexpr int kTileReaders = Traits::kMmaThreads + 32;  // + the dQ writer warp
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_dq.get_tma_descriptor());
    if (Traits::kdKVByTma && p.dkv_tma) {
      cute::prefetch_tma_descriptor(p.tma_dk.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_dv.get_tma_descriptor());
    }
    shared.kv_full.init(1);
    shared.kv_empty.init(Traits::kMmaThreads);
    shared.tiles.init(kTileReaders);
    // Deterministic: the CTA's tile is a ticket drawn as it starts, so the CTAs it waits for have started, whatever
    // order the hardware dispatches blockIdx in.
    if (p.dq_semaphore) shared.ticket = atomicAdd(p.dq_semaphore + p.m_blocks * p.batch * p.nheads, 1);
  }
  // Q and dO have a ring each: a stage is released once the last GEMM that reads it has retired (dO after dV's and
  // dP's, Q after dK's), which is later for Q.
  typename Pipeline::Params pipe_params;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kMmaThreads;
  pipe_params.transaction_bytes = Traits::kBytesQ;
  Pipeline q_pipe(shared.q_pipe, pipe_params, Shape<_1, _1, _1>{});
  typename PipelinedO::Params do_pipe_params;
  do_pipe_params.role = warpgroup == 0 ? PipelinedO::ThreadCategory::Producer : PipelinedO::ThreadCategory::Consumer;
  do_pipe_params.is_leader = pipe_params.is_leader;
  do_pipe_params.num_consumers = pipe_params.num_consumers;
  do_pipe_params.transaction_bytes = Traits::kBytesQ;  // dO's tile and D's box
  PipelinedO do_pipe(shared.do_pipe, do_pipe_params, Shape<_1, _1, _1>{});
  __syncthreads();  // the barriers are initialised (and the ticket drawn) before anyone waits on them
  // A CTA-per-tile kernel's tile: its blockIdx.x, which work_of below does not read, or in deterministic mode its
  // ticket. Persistent CTAs draw every tile from the counter (the producer, below).
  const int first_tile = p.dq_semaphore ? shared.ticket : int(blockIdx.x);
  // The work of tile t: persistent kernels take t apart; the others have one tile, their blockIdx, or in deterministic
  // mode their ticket taken apart as blockIdx would be.
  auto work_of = [&](int t) {
    if constexpr (kPersistent) {
      const int walks = p.tile_heads;
      return bwd_work<kBlockM, kBlockN, kPacks>(p, t % p.n_blocks, t / p.n_blocks % walks, t / p.n_blocks / walks);
    } else if (p.dq_semaphore) {
      return bwd_work<kBlockM, kBlockN, kPacks>(p, t % int(gridDim.x), t / int(gridDim.x) % int(gridDim.y),
                                                t / int(gridDim.x * gridDim.y));
    } else {
      return bwd_work<kBlockM, kBlockN, kPacks>(p, int(blockIdx.x), int(blockIdx.y), int(blockIdx.z));
    }
  };
  // Tile i of this CTA: from the producer's mailbox (two slots, so that it may draw one ahead; past the last: none)
  // where the kernel is persistent (config.h: bwd_persistent), else the CTA's one tile.
  auto take_tile = [&](int i) {
    if constexpr (kPersistent) {
      return shared.tiles.take(i);
    } else {
      return first_tile;
    }
  };

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});     // (M, d, stages)
  Tensor sdO = make_tensor(make_smem_ptr(shared.dO.data()), typename Traits::SmemLayoutdO{});  // (M, d, stages)
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});     // (N, d)
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});     // (N, d)

  if (warpgroup == 0) {
    // ------------------------------------------------------------------------------------------ producer
    // The loads and the dQ writer need few registers; the MMA warpgroups get the rest (bwd_traits.h: kProducerRegs).
    static_assert(kWarpgroupThreads * Traits::kProducerRegs + Traits::kMmaThreads * Traits::kMmaRegs <=
                      168 * kBwdThreads,
                  "setmaxnreg's pool");
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp == 1) {
      // ---------------------------------------------------------------------------------------- dQ writer
      // Each query block's dQ share (wide: each 128-column half of it), staged by the MMA warpgroups, reduced into
      // dq_accum by TMA (two boxes per slab; rows past seqlen_q are clipped), so the MMA warps issue no atomics. One
      // lane issues and waits: bulk groups are per-thread state.
      const bool leader = cute::elect_one_sync();
      constexpr int kHalves = kHeadDim / Traits::kdQCols;
      // A slab is free again once its reduce has read it. The MMA warpgroup's first wait is met by its own arrive, so
      // the writer's arrivals after a tile's last block wait for the next tile with blocks: none is left half-arrived
      // at exit.
      bool owed = false;
      for (int tile_i = 0; kPersistent || tile_i == 0; ++tile_i) {
        const int t = take_tile(tile_i);
        if (t >= num_tiles) break;
        const BwdWork w = work_of(t);
        const SeqRows seq = seq_rows<kPacks>(p, w.batch);
        const int m_count = w.m_end - w.m_begin, n_block = w.n_block;
        if (m_count <= 0) continue;
        if (owed) {
          cutlass::arch::NamedBarrier::arrive(kdQThreads, kdQEmpty);
          cutlass::arch::NamedBarrier::arrive(kdQThreads, kdQEmpty + 1);
        }
        // Deterministic: the adds into a query block's dQ in a fixed order (wait_for_turn), so the sums round the
        // same every run. The semaphores are (query block, batch, head): the heads polling at once sit on different
        // lines.
        const int semaphore_stride = p.batch * p.nheads;
        const RotatedTurns rotated(n_block, p.n_blocks, max(m_count, 1));
        for (int i = 0, m = w.m_first, head = w.head; i < w.steps; ++i, m = w.next(m), head += w.new_head(m)) {
          Tensor mdQ = domain_offset(make_coord(seq.q_shift, _0{}),  // (rows, d)
                                     p.tma_dq.get_tma_tensor(p.shape_q)(_, _, head, seq.q_coord));
          Tensor gdQ = local_tile(mdQ, typename Traits::dQSlab{}, make_coord(_, _));  // (M, 64, m, slab)
          int* semaphore = p.dq_semaphore ? p.dq_semaphore + w.batch * p.nheads + head : nullptr;
          // Persistent tiles: the converter's count of this query block's shares in (bwd_dq_convert.h).
          int* done = kPersistent && p.dq_done ? p.dq_done + w.batch * p.nheads + head : nullptr;
          if (semaphore && leader) {
            const int n_blocks = kPacks ? ceil_div(seq.seqlen_k, kBlockN) : p.n_blocks;  // the sequence's
            const int visitors = dq_visitors<kBlockM, kBlockN>(m, seq.seqlen_q, seq.seqlen_k, n_blocks, p.causal);
            const int turn = p.causal ? visitors - 1 - n_block : p.dq_rotate ? rotated(m - w.m_begin) : n_block;
            wait_for_turn(semaphore + m * semaphore_stride, turn);
          }
          __syncwarp();
          CUTE_UNROLL
          for (int h = 0; h < kHalves; ++h) {
            const bool last = i + 1 == w.steps && h + 1 == kHalves;
            CUTE_UNROLL
            for (int wg = 0; wg < kBwdMmaWarpgroups; ++wg) {
              Tensor sdQw = make_tensor(
                  make_smem_ptr(shared.dq.data() + wg * cosize(typename Traits::SmemLayoutdQSlab{})),
                  typename Traits::SmemLayoutdQSlab{});
              auto [tdQg, tdQs] = tma_partition(p.tma_dq, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdQw),
                                                group_modes<0, 2>(gdQ(_, _, m, h * kBwdMmaWarpgroups + wg)));
              cutlass::arch::NamedBarrier::sync(kdQThreads, kdQFull + wg);
              if (leader) {
                copy(p.tma_dq, tdQs, tdQg);
                tma_store_arrive();
              }
              __syncwarp();  // converged again before the next bar.sync
            }
            if (leader) tma_store_wait<1>();
            __syncwarp();
            if (!last) cutlass::arch::NamedBarrier::arrive(kdQThreads, kdQEmpty);
            if (leader) tma_store_wait<0>();
            __syncwarp();
            if (!last) cutlass::arch::NamedBarrier::arrive(kdQThreads, kdQEmpty + 1);
          }
          if (semaphore && leader) pass_turn(semaphore + m * semaphore_stride);
          if (done && leader) pass_turn(done + m * semaphore_stride);  // complete in global memory, then counted
          __syncwarp();
        }
        owed = true;
      }
      return;
    }
    if constexpr (kPersistent) {
      if (warp >= kConvertWarp) {
        if (p.dq_done) convert_dq<kBlockM, kBlockN, kHeadDim, kPacks, Element>(p, threadIdx.x - kConvertWarp * 32);
        return;
      }
    }
    if (warp != 0 || !cute::elect_one_sync()) return;
    // Every key block of the head reads the same Q and dO blocks: keep them in L2. Not unrolled over the ring's
    // stages: at d256 (10 boxes a block) the unrolled loop keeps more shared-memory addresses live than the producer's
    // 40 registers hold (ptxas spilled 8 bytes).
    auto stage = cutlass::make_producer_start_state<Pipeline>();
    auto do_stage = cutlass::make_producer_start_state<PipelinedO>();  // dO has its own ring (one stage at d256)
    int kv_loads = 0;
#pragma unroll 1
    for (int tile_i = 0, t = first_tile; kPersistent || tile_i == 0; ++tile_i) {
      if constexpr (kPersistent) {
        // The next tile: persistent CTAs draw it from the counter once the previous tile's loads are issued (about
        // two blocks before its end, so that a CTA commits late, as the hardware's dispatch would), a CTA per tile
        // (deterministic mode) none. Then it is published (a tile past the last tells the other warps to stop).
        // The first tile too comes from the counter: a CTA that starts late (its SM held by another stream's work)
        // finds the tiles taken, so the converters of the running CTAs, which wait for every tile's dQ shares
        // (bwd_dq_convert.h), never wait for a CTA that has not started.
        if (p.tile_counter) {
          t = atomicAdd(p.tile_counter, 1);
        } else if (tile_i > 0) {
          t = num_tiles;
        }
        shared.tiles.put(tile_i, t);
        if (t >= num_tiles) break;
      }
      const BwdWork w = work_of(t);
      const int m_count = w.m_end - w.m_begin, head_kv = w.head / p.head_group_kv;
      if (m_count <= 0) continue;
      // (rows, d) of this sequence and head, the coordinates shifted so that TMA's row bound is the sequence's end.
      const SeqRows seq = seq_rows<kPacks>(p, w.batch);
      Tensor mK = domain_offset(make_coord(seq.k_shift, _0{}),
                                p.tma_k.get_tma_tensor(p.shape_k)(_, _, head_kv, seq.k_coord));
      Tensor mV = domain_offset(make_coord(seq.k_shift, _0{}),
                                p.tma_v.get_tma_tensor(p.shape_k)(_, _, head_kv, seq.k_coord));
      Tensor gK = local_tile(mK, Shape<N, D>{}, make_coord(w.n_block, _0{}));  // (N, d)
      Tensor gV = local_tile(mV, Shape<N, D>{}, make_coord(w.n_block, _0{}));
      auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      Tensor mLse = p.tma_lse.get_tma_tensor(make_shape(p.stats_total));
      Tensor mD = p.tma_d.get_tma_tensor(make_shape(p.stats_total));
      using SB = typename Traits::StatsBox;
#pragma unroll 1
      for (int i = 0, m = w.m_first, head = w.head; i < w.steps;
           ++i, m = w.next(m), head += w.new_head(m), ++stage, ++do_stage) {
        Tensor mQ =
            domain_offset(make_coord(seq.q_shift, _0{}), p.tma_q.get_tma_tensor(p.shape_q)(_, _, head, seq.q_coord));
        Tensor mdO =
            domain_offset(make_coord(seq.q_shift, _0{}), p.tma_do.get_tma_tensor(p.shape_q)(_, _, head, seq.q_coord));
        Tensor gQ = local_tile(mQ, Shape<M, D>{}, make_coord(_, _0{}));  // (M, d, query blocks)
        Tensor gdO = local_tile(mdO, Shape<M, D>{}, make_coord(_, _0{}));
        auto [tQgQ, tQsQ] =
            tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        auto [tdOgdO, tdOsdO] =
            tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
        // lse and D of query block m: a box of the flat buffers from this head's first row rounded down to 4 floats.
        const int stats0 = stats_row<kPacks>(p, seq, w.batch, head) & ~3;
        q_pipe.producer_acquire(stage);  // waits for the stage to be free, then expects its bytes (Q's and lse's)
        copy(p.tma_q.with(*q_pipe.producer_get_barrier(stage), 0, TMA::CacheHintSm90::EVICT_LAST), tQgQ(_, m),
             tQsQ(_, stage.index()));
        {
          Tensor gL = local_tile(domain_offset(make_coord(stats0 + m * kBlockM), mLse), Shape<SB>{}, make_coord(0));
          Tensor sL = make_tensor(make_smem_ptr(shared.lse.data() + stage.index() * Traits::kStatsStage), Layout<SB>{});
          auto [tg, ts] =
              tma_partition(p.tma_lse, Int<0>{}, Layout<_1>{}, group_modes<0, 1>(sL), group_modes<0, 1>(gL));
          copy(p.tma_lse.with(*q_pipe.producer_get_barrier(stage), 0, TMA::CacheHintSm90::EVICT_LAST), tg, ts);
        }
        do_pipe.producer_acquire(do_stage);  // dO's and D's
        copy(p.tma_do.with(*do_pipe.producer_get_barrier(do_stage), 0, TMA::CacheHintSm90::EVICT_LAST), tdOgdO(_, m),
             tdOsdO(_, do_stage.index()));
        {
          Tensor gD = local_tile(domain_offset(make_coord(stats0 + m * kBlockM), mD), Shape<SB>{}, make_coord(0));
          Tensor sD = make_tensor(make_smem_ptr(shared.d.data() + do_stage.index() * Traits::kStatsStage), Layout<SB>{});
          auto [tg, ts] = tma_partition(p.tma_d, Int<0>{}, Layout<_1>{}, group_modes<0, 1>(sD), group_modes<0, 1>(gD));
          copy(p.tma_d.with(*do_pipe.producer_get_barrier(do_stage), 0, TMA::CacheHintSm90::EVICT_LAST), tg, ts);
        }
        if (i == 0) {
          // K and V after the first Q and dO: the previous tile's K and V are free only once its last dQ GEMM retired,
          // and its last stages free the ring for this tile's first block earlier.
          if (kPersistent && kv_loads > 0) shared.kv_empty.wait((kv_loads - 1) & 1);
          shared.kv_full.arrive_and_expect_tx(Traits::kBytesKV);
          copy(p.tma_k.with(reinterpret_cast<uint64_t&>(shared.kv_full), 0), tKgK, tKsK);
          copy(p.tma_v.with(reinterpret_cast<uint64_t&>(shared.kv_full), 0), tVgV, tVsV);
          ++kv_loads;
        }
      }
    }
    q_pipe.producer_tail(stage);  // no exit while loads into this CTA's shared memory are in flight
    do_pipe.producer_tail(do_stage);
    return;
  }

  // -------------------------------------------------------------------------------------------- MMA warpgroups
  cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegs>();
  if constexpr (Traits::kWide) {
    // One tile per CTA: bwd_mma_wide's rings start afresh and it never frees K and V for a next tile.
    static_assert(!kPersistent, "config.h: bwd_persistent");
    const BwdWork w = work_of(first_tile);
    bwd_mma_wide<Traits>(p, shared, q_pipe, do_pipe, w);
  } else {
    const int tid = threadIdx.x - kWarpgroupThreads;
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    auto thr_dkv = mma_dkv.get_thread_slice(tid);
    auto thr_dq = mma_dq.get_thread_slice(tid);
    // The shared-memory operands' wgmma descriptors depend on the warpgroup only (config.h: bwd_uniform_descriptors).
    const int desc_tid =
        Traits::kUniformDescriptors ? (cutlass::canonical_warp_group_idx() - 1) * kWarpgroupThreads : tid;
    auto desc_sdp = mma_sdp.get_thread_slice(desc_tid);
    auto desc_dkv = mma_dkv.get_thread_slice(desc_tid);
    auto desc_dq = mma_dq.get_thread_slice(desc_tid);
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<N, D>{});
    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<N, D>{});
    Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQt{});     // (d, M, stages)
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dO.data()), typename Traits::SmemLayoutdOt{});  // (d, M, stages)
    Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKt{});     // (d, N)
    Tensor sdS = make_tensor(make_smem_ptr(shared.dS.data()), typename Traits::SmemLayoutdS{});    // (M, N, stages)
    Tensor sdSt = make_tensor(make_smem_ptr(shared.dS.data()), typename Traits::SmemLayoutdSt{});  // (N, M, stages)
    // Operands: K and V are S^T's and dP^T's A (M = keys), Q and dO their B (N = queries); dO^T and Q^T are dV's and
    // dK's B (N = d, K = queries); dS and K^T are dQ's A and B (swapped: dQ^T's B and A).
    Tensor tSrK = desc_sdp.partition_fragment_A(sK);
    Tensor tSrQ = desc_sdp.partition_fragment_B(sQ);
    Tensor tdPrV = desc_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = desc_sdp.partition_fragment_B(sdO);
    Tensor tdVrdO = desc_dkv.partition_fragment_B(sdOt);
    Tensor tdKrQ = desc_dkv.partition_fragment_B(sQt);
    Tensor tdQrdS = partition_fragment_ab<!kdQSwapAB>(desc_dq, sdS);
    Tensor tdQrK = partition_fragment_ab<kdQSwapAB>(desc_dq, sKt);
    const int mma_warpgroup = warpgroup - 1;
    bool slab_used = false;
    // dS^T registers -> sdS through the transposed view (stmatrix.trans).
    auto r2s_ds = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, mma_sdp);
    auto thr_r2s_ds = r2s_ds.get_thread_slice(tid);
    Tensor tdSsdS = thr_r2s_ds.partition_D(as_position_independent_swizzle_tensor(sdSt));  // (CPY, .., .., stages)
    // The (query, key) of each S^T register as (rows = queries, cols = keys), and the (query, column) of each dQ one.
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<N, M>{}));
    Tensor cS_rc = make_tensor(cS.data(), rowcol_t(cS.layout()));
    constexpr int kRows = decltype(size<0>(cS_rc))::value;  // queries per thread
    typename Traits::PipelineState stage;  // the rings run on across tiles
    int kv_loads = 0;

    for (int tile_i = 0; kPersistent || tile_i == 0; ++tile_i) {
      const int t = take_tile(tile_i);
      if (t >= num_tiles) break;
      const BwdWork w = work_of(t);
      const int n_block = w.n_block, batch = w.batch, m_count = w.m_end - w.m_begin;
      // The 80-row tile's lengths are the parameters' (uniform): as a field of w the diagonal took a register and that
      // tile spilled.
      const SeqRows seq = seq_rows<kPacks>(p, batch);
      const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, diagonal = seqlen_k - seqlen_q;
      // The walk's head's first row in the stats box: each next head's starts stats_head_rows rows later.
      int stats_shift = stats_row<kPacks>(p, seq, batch, w.head) & 3;
      clear(tdKrdK);
      clear(tdVrdV);
      if (m_count > 0 && !slab_used) {
        // Stands in for the writer's first "empty": the slab starts free.
        if (warp % 4 == 0) cutlass::arch::NamedBarrier::arrive(kdQThreads, kdQEmpty + mma_warpgroup);
        slab_used = true;
      }
      if (m_count > 0) shared.kv_full.wait(kv_loads++ & 1);
      for (int i = 0, m = w.m_first; i < w.steps;
           ++i, m = w.next(m), stats_shift = (stats_shift + (w.new_head(m) ? p.stats_head_rows : 0)) & 3, ++stage) {
        const int s = stage.index(), query0 = m * kBlockM, key0 = n_block * kBlockN;
        // S^T = K Q^T and dP^T = V dO^T, both in flight; P's exp2 overlaps dP's GEMM.
        Tensor tSrS = partition_fragment_C(mma_sdp, Shape<N, M>{});
        Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<N, M>{});
        q_pipe.consumer_wait(stage);
        warpgroup_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, s), tSrS);
        do_pipe.consumer_wait(stage);
        warpgroup_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, s), tdPrdP);
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);  // S^T is read only after its GEMM retired
        // P = exp2(S * scale_log2 - lse * log2(e)) (reference: p = exp(s * scale - lse)); keys past seqlen_k and,
        // causal, keys past a query's diagonal are masked to P = 0. Only blocks that reach an edge pay for the test.
        Tensor scores = make_tensor(tSrS.data(), rowcol_t(tSrS.layout()));  // (queries, keys)
        const bool edge = key0 + kBlockN > seqlen_k || (p.causal && key0 + kBlockN - 1 > query0 + diagonal);
        // lse of each query as its row is used, from shared memory (Q's stage): kRows registers held across the GEMMs
        // spilled at 128 queries per block. Rows past seqlen_q (the box ran into the next head's, or zeros), and rows
        // that saw no key in the forward (lse = -inf), get lse = +inf so that P = 0 there (sm80/bwd_tile.h does the same).
        const float* lse_s = shared.lse.data() + s * Traits::kStatsStage + stats_shift;
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const int row = get<1>(cS_rc(mi, 0)), query = query0 + row;
          const float l = query < seqlen_q ? lse_s[row] : INFINITY;
          const float lse_log2 = l == -INFINITY ? INFINITY : l * float(M_LOG2E);
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(scores); ++ni) {
            scores(mi, ni) = exp2f(scores(mi, ni) * p.scale_log2 - lse_log2);
          }
        }
        if (edge) {
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi) {
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(scores); ++ni) {
              const int key = key0 + get<0>(cS_rc(mi, ni)), query = query0 + get<1>(cS_rc(mi, ni));
              if (key >= seqlen_k || (p.causal && key > query + diagonal)) scores(mi, ni) = 0.f;
            }
          }
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdPrdP);
        // dS = P * (dP - D) (reference: ds = p * (dp - D)), in dP's registers.
        Tensor ds = make_tensor(tdPrdP.data(), scores.layout());
        const float* d_s = shared.d.data() + s * Traits::kStatsStage + stats_shift;  // D: with dO's stage, as lse
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const int row = get<1>(cS_rc(mi, 0)), query = query0 + row;
          const float d_row = query < seqlen_q ? d_s[row] : 0.f;
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(ds); ++ni) ds(mi, ni) = scores(mi, ni) * (ds(mi, ni) - d_row);
        }
        Tensor rP = make_tensor<Element>(tSrS.layout());
        convert(tSrS, rP);
        Tensor rdS = make_tensor<Element>(tdPrdP.layout());
        convert(tdPrdP, rdS);
        // dS^T -> sdS[s]. Stage s was last read by dQ's GEMM two query blocks ago, which both warpgroups finished
        // before either passed the previous block's dS barrier: no barrier needed before the write.
        copy(r2s_ds, thr_r2s_ds.retile_S(rdS), tdSsdS(_, _, _, s));
        // dV += P^T dO, P^T straight from registers (relabelled as an A operand).
        Tensor tdVrP = make_tensor(rP.data(), as_operand_a(tSrS.layout()));
        warpgroup_gemm<false, -1>(mma_dkv, tdVrP, tdVrdO(_, _, _, s), tdVrdV);
        // dS visible to the async proxy (wgmma reads shared memory through it), and complete from both warpgroups.
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(Traits::kMmaThreads, kdSBarrier);
        // dQ = dS K (swapped: dQ^T = K^T dS^T); returns once dV's GEMM retired, so dO's stage is free.
        Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Traits::dQShape{});
        if constexpr (kdQSwapAB) {
          warpgroup_gemm<true, 1>(mma_dq, tdQrK, tdQrdS(_, _, _, s), tdQrdQ);
        } else {
          warpgroup_gemm<true, 1>(mma_dq, tdQrdS(_, _, _, s), tdQrK, tdQrdQ);
        }
        do_pipe.consumer_release(stage);
        // dK += dS^T Q, dS^T from registers; returns once dQ's GEMM retired.
        Tensor tdKrdS = make_tensor(rdS.data(), as_operand_a(tdPrdP.layout()));
        warpgroup_gemm<false, 1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, s), tdKrdK);
        // K and V's last reads retired with dQ's GEMM; where dK and dV leave through their memory, only after that.
        if (kPersistent && i + 1 == w.steps && !(Traits::kdKVByTma && p.dkv_tma)) shared.kv_empty.arrive();
        warpgroup_fence_operand(tdQrdQ);
        // This key block's share of dQ to the writer warp, while dK's GEMM runs: into the slab once the writer's
        // previous reduce has read it, then made visible to TMA (the async proxy).
        hand_dq_to_writer<Traits>(mma_dq, tid, tdQrdQ, shared.dq.data(), mma_warpgroup);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdKrdK);
        q_pipe.consumer_release(stage);  // dK's GEMM, Q's last reader, retired
      }

      // ------------------------------------------------------------------------------------------ epilogue
      // dK = softmax_scale * sum dS^T Q (reference: dk = scale * ds^T q) and dV, for this walk's slice: rows past
      // seqlen_k are not written (a packed sequence's rows from its first key).
      const int slice = w.head / p.walk_heads;
      if constexpr (Traits::kdKVByTma) {
        // Not a tile without queries (a packed sequence's keys past its queries' reach), whose K and V were not loaded
        // and whose zeros the registers store: the next tile's K and V may be landing in that memory.
        if (p.dkv_tma && w.steps > 0) {
          // Into K's and V's shared memory (stmatrix) once both warpgroups' last GEMMs retired (the other's dQ GEMM
          // reads all of K), then one TMA store each, which drops the rows past seqlen_k (a packed sequence's end).
          cutlass::arch::NamedBarrier::sync(Traits::kMmaThreads, kdSBarrier);
          Tensor sdK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});  // (N, d)
          Tensor sdV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});
          auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
          auto thr_r2s = r2s.get_thread_slice(tid);
          CUTE_UNROLL
          for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.softmax_scale;
          Tensor rdK = make_tensor<Element>(tdKrdK.layout());
          convert(tdKrdK, rdK);
          copy(r2s, thr_r2s.retile_S(rdK), thr_r2s.partition_D(sdK));
          Tensor rdV = make_tensor<Element>(tdVrdV.layout());
          convert(tdVrdV, rdV);
          copy(r2s, thr_r2s.retile_S(rdV), thr_r2s.partition_D(sdV));
          cutlass::arch::fence_view_async_shared();  // the generic-proxy writes, before the copy engine reads them
          cutlass::arch::NamedBarrier::sync(Traits::kMmaThreads, kdSBarrier);
          if (tid == 0) {
            const SeqRows kseq = seq_rows<kPacks>(p, batch);  // read again, not held across the walk
            auto store = [&](auto const& tma, auto const& s) {
              Tensor g = local_tile(domain_offset(make_coord(kseq.k_shift, _0{}),
                                                  tma.get_tma_tensor(p.shape_k)(_, _, slice, kseq.k_coord)),
                                    Shape<N, D>{}, make_coord(n_block, _0{}));  // (N, d)
              auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
              copy(tma, ts, tg);
            };
            store(p.tma_dk, sdK);
            store(p.tma_dv, sdV);
            tma_store_arrive();
            tma_store_wait<0>();  // no exit, and no next tile's K and V, while the copy engine reads them
          }
          __syncwarp();  // converged again after the one-thread branch
          if constexpr (kPersistent) {
            cutlass::arch::NamedBarrier::sync(Traits::kMmaThreads, kdSBarrier);  // the store has read K and V
            shared.kv_empty.arrive();
          }
          continue;  // the tile is done
        }
      }
      // From registers: element pairs, or fp32 pairs where the host sums a group's walks afterwards.
      Tensor cKV = thr_dkv.partition_C(make_identity_tensor(Shape<N, D>{}));
      Tensor cKV_rc = make_tensor(cKV.data(), rowcol(cKV.layout()));  // (keys, columns)
      Tensor dk = make_tensor(tdKrdK.data(), rowcol(tdKrdK.layout()));
      Tensor dv = make_tensor(tdVrdV.data(), rowcol(tdVrdV.layout()));
      // The sequence's first key read again here, not held across the walk (a register of the d64 loop's).
      const int k_start = seq_rows<kPacks>(p, batch).k_start;
      const int64_t dk_base = batch * p.dk_batch_stride + k_start * p.dk_row_stride + slice * p.dk_head_stride;
      const int64_t dv_base = batch * p.dv_batch_stride + k_start * p.dv_row_stride + slice * p.dv_head_stride;
      cutlass::NumericArrayConverter<Element, float, 2> cvt;
      CUTE_UNROLL
      for (int r = 0; r < size<0>(dk); ++r) {
        const int key = n_block * kBlockN + get<0>(cKV_rc(r, 0));
        if (key >= seqlen_k) continue;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(dk); c += 2) {
          const int col = get<1>(cKV_rc(r, c));
          const int64_t k_off = dk_base + key * p.dk_row_stride + col, v_off = dv_base + key * p.dv_row_stride + col;
          cutlass::Array<float, 2> k2, v2;
          k2[0] = dk(r, c) * p.softmax_scale, k2[1] = dk(r, c + 1) * p.softmax_scale;
          v2[0] = dv(r, c), v2[1] = dv(r, c + 1);
          if (p.dkv_fp32) {
            *reinterpret_cast<cutlass::Array<float, 2>*>(static_cast<float*>(p.dk) + k_off) = k2;
            *reinterpret_cast<cutlass::Array<float, 2>*>(static_cast<float*>(p.dv) + v_off) = v2;
          } else {
            *reinterpret_cast<cutlass::Array<Element, 2>*>(static_cast<Element*>(p.dk) + k_off) = cvt(k2);
            *reinterpret_cast<cutlass::Array<Element, 2>*>(static_cast<Element*>(p.dv) + v_off) = cvt(v2);
          }
        }
      }
    }
  }
#endif
}

}  // namespace fa2::sm90
