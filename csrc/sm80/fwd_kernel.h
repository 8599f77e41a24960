// FlashAttention-2 forward for one (query block, head, batch): reference.py's flash_fwd_tiled on
// tensor cores. Names follow CuTe: g* global, s* shared, r* registers; tXgY / tXsY / tXrY are tensor Y
// partitioned for operation X (tQ/tK/tV: gmem->smem copies, tS: the S = Q K^T MMA, tO: the O += P V MMA).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "sm80/config.h"
#include "sm80/dropout.h"
#include "sm80/mask.h"
#include "common/params.h"
#include "common/pdl.h"
#include "common/schedule.h"
#include "common/seqlen.h"
#include "sm80/softmax.h"
#include "sm80/utils.h"

namespace fa2 {
using namespace cute;

// kTransforms: which of softcap, ALiBi and dropout are compiled in (the launch picks the smallest instance that covers
// the call: their code costs the plain loop registers and scheduling, docs/tuning.md#features-off). A window's left
// edge comes with them, as its mask code alone moved the plain loop's schedule; a right edge (causal's) and sinks are
// in every instance.
template <typename Traits, ScoreTransforms kTransforms>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(const __grid_constant__ FwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using BlockQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using BlockKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using BlockS = Shape<Int<kBlockM>, Int<kBlockN>>;

  constexpr int kStages = Traits::kStages;
  constexpr int kKVElems = Traits::kKVElems;

  const BlockHead work = scheduled_block</*kHeavyLast=*/true>(p);
  const int m_block = work.block, head = work.head;
  // Split-KV (params.h) runs in the kLogits instance only: its code, even unused, moved the plain loop's schedule,
  // and in kAll it spilled next to dropout's (docs/tuning.md#split-kv). So a split call is a kLogits one
  // (the launch plan's transforms: host/plan.cpp), and the plan never splits a call with dropout.
  constexpr bool kSplitKV = kTransforms == ScoreTransforms::kLogits;
  const bool splits = kSplitKV && p.num_splits > 1;
  const int batch = splits ? int(blockIdx.z) % p.batch : int(blockIdx.z);
  const int split = splits ? int(blockIdx.z) / p.batch : 0;
  const int head_kv = head / (p.nheads / p.nheads_k);  // GQA/MQA: query heads share a K/V head
  const int tid = threadIdx.x;
  const int row_offset = m_block * kBlockM;
  const SeqInfo seq(p, batch, head);
  // A paged cache (below): the table row's first entries, one a lane, in flight beside cache_seqlens.
  constexpr bool kPagedKV = kBlockM == kPagedTileRows && kTransforms == ScoreTransforms::kLogits;
  const bool paged = kPagedKV && p.cache.block_table != nullptr;
  const int row_lanes = paged ? PageCursor<kBlockN>::row_lanes(p.cache, batch) : 0;
  // Launched early behind the KV append (common/pdl.h): nothing above reads what the append writes (q_rotated, the
  // cache's new rows). The split-KV combine may then launch (it waits for this grid in turn).
  wait_for_previous_kernel();
  let_next_kernel_launch();
  if (row_offset >= seq.seqlen_q) return;  // varlen: the grid is sized for the longest sequence
  KeyBlocks blocks = key_blocks<kBlockM, kBlockN>(p, m_block, seq.seqlen_q, seq.seqlen_k);
  if (splits) blocks = split_share(blocks, split, p.num_splits);
  const int n_block_begin = blocks.begin, n_block_end = blocks.end;

  // Full tensors of this (sequence, head), then this block's tiles.
  Tensor mQ = seq.q_tensor<kHeadDim, const Element>(p.q, p.q_stride, batch, head);
  Tensor mK = seq.k_tensor<kHeadDim, const Element>(p.k, p.k_stride, seq.kv_batch, head_kv);
  Tensor mV = seq.k_tensor<kHeadDim, const Element>(p.v, p.v_stride, seq.kv_batch, head_kv);
  Tensor gQ = local_tile(mQ, BlockQ{}, make_coord(m_block, 0));  // (kBlockM, kHeadDim)
  Tensor gK = local_tile(mK, BlockKV{}, make_coord(_, 0));        // (kBlockN, kHeadDim, n_blocks)
  Tensor gV = local_tile(mV, BlockKV{}, make_coord(_, 0));

  extern __shared__ char smem[];
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + cosize(typename Traits::SmemLayoutQ{}), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + kStages * kKVElems, typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutQ{});  // Q is dead by the epilogue

  // Global -> shared copies, and the (row, col) each thread's chunk covers, for predication.
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKgK = gmem_thr.partition_S(gK);  // (CPY, CPY_N, CPY_K, n_blocks)
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVgV = gmem_thr.partition_S(gV);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(BlockQ{}));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(BlockKV{}));

  // MMA partitions: register fragments for Q, K, V^T and the accumulators.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(make_tensor(sV.data(), typename Traits::SmemLayoutVtShape{}));
  Tensor acc_o = partition_fragment_C(tiled_mma, BlockQ{});  // (MMA, MMA_M, MMA_K) fp32
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(BlockS{}));
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(BlockQ{}));

  // Shared -> register copies (ldmatrix), laid out to match the MMA fragments.
  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_k = smem_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_k.partition_S(sK);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, tiled_mma);
  auto smem_thr_v = smem_copy_v.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_v.partition_S(sVt);

  constexpr int kRowsPerThread = decltype(size<0>(rowcol_layout(acc_o.layout())))::value;
  OnlineSoftmax<kRowsPerThread> softmax;  // starts empty: m = -inf, l = 0
  clear(acc_o);

  // One key block's two GEMMs and the softmax between them; sK/sV hold its K and V at `kv_offset`.
  // P goes to the second MMA as its A operand, straight from registers.
  constexpr bool kLogits = kTransforms != ScoreTransforms::kNone;
  // A window's left edge masks in the other instances only (the plan's transforms, common/plan.h), so the plain
  // loop's mask code is causal's and seqlen_k's alone.
  constexpr bool kLeftBand = kLogits;
  const float alibi = kLogits ? alibi_slope(p, batch, head) : 0.f;
  const bool softcap = kLogits && p.softcap_in > 0.f;
  const bool transform_scores = softcap || alibi != 0.f;
  const bool dropout = kTransforms == ScoreTransforms::kAll && p.rng_state != nullptr;
  // ALiBi's row term of the current tile, which the softmax adds per row (apply_alibi_split); 0 elsewhere. Only the
  // kLogits instance splits: in kAll the split's registers spill next to dropout's (docs/tuning.md#alibi-distances).
  constexpr bool kSplitAlibi = kTransforms == ScoreTransforms::kLogits;
  float alibi_rows[kRowsPerThread] = {};
  auto s_gemm = [&](auto& acc_s, int n_block, int kv_offset) {
    clear(acc_s);
    gemm_ss(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, make_tensor(tSsK.data() + kv_offset, tSsK.layout()), smem_copy_q,
            smem_copy_k, smem_thr_q, smem_thr_k);
    // One branch for all of them, as the mask alone had: each branch between the GEMM and the softmax is a
    // scheduling barrier in the loop every plain tile runs.
    const bool mask = n_block >= blocks.right_masked_begin || (kLeftBand && n_block < blocks.left_masked_end);
    if (transform_scores || mask) {
      if (softcap) apply_softcap(acc_s, p.softcap_in);
      if (alibi != 0.f) {
        // A tile on one side of the diagonal takes the split form; one that the diagonal crosses, the per-score one.
        const int diagonal = seq.seqlen_k - seq.seqlen_q, col_offset = n_block * kBlockN;
        const int nearest = row_offset + diagonal - (col_offset + kBlockN - 1);  // its smallest distance
        const int farthest = row_offset + kBlockM - 1 + diagonal - col_offset;   // its largest
        const int sign = !kSplitAlibi ? 0 : nearest >= 0 ? 1 : farthest <= 0 ? -1 : 0;
        if (sign != 0) {
          apply_alibi_split(acc_s, tScS, alibi, sign, row_offset, col_offset, diagonal, alibi_rows);
        } else {
          apply_alibi(acc_s, tScS, alibi, row_offset, col_offset, diagonal);
          CUTE_UNROLL
          for (int mi = 0; mi < kRowsPerThread; ++mi) alibi_rows[mi] = 0.f;
        }
      }
      if (mask) apply_mask<kLeftBand>(acc_s, tScS, p, row_offset, n_block * kBlockN, seq.seqlen_q, seq.seqlen_k);
    }
  };
  // Softcap without ALiBi bounds every score: t = tanh(.) is in [-1, 1], so with m fixed at 0 every P = exp2(t *
  // scale_log2) lies in 2^[-72.2, 72.2] for softcap <= 50 (scale_log2 = softcap * log2 e). The loop then skips the
  // running max (an FMNMX per score) and the rescale test (docs/tuning.md#softcap-fixed-max). bf16 only: P goes to the
  // P V GEMM in the input type, and fp16's range (2^-24 to 2^16) cannot hold that span, bf16's (fp32's) can. It narrows
  // the |V| that O holds in fp32: below 2^128 / (seqlen_k * 2^72.2), 2^35 at 2^20 keys, and above 2^-54 for rows at the
  // range's low end (products under 2^-126 flush). Not with a sink: finalize() combines it with m in the exp domain,
  // where m = 0 against a sink beyond +-87 underflows.
  constexpr bool kFixedMaxType = std::is_same_v<Element, cutlass::bfloat16_t>;
  const bool fixed_max = kFixedMaxType && kSplitAlibi && softcap && alibi == 0.f && p.sink == nullptr &&
                         p.score_scale <= 50.f;
  if (fixed_max) softmax.fix_max(0.f);
  const DropoutDraw draw(p, batch, head);
  auto softmax_pv = [&](auto& acc_s, int n_block, int kv_offset) {
    // l sums the probabilities before dropout
    softmax.update<kSplitAlibi>(acc_s, acc_o, p.scale_log2, alibi_rows, fixed_max);
    if (dropout) {
      Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
      for_each_kept<kBlockN >= 64 ? 4 : 0, /*kInline=*/true>(acc_s, tScS, draw, row_offset, n_block * kBlockN,
                                                             [&](int mi, int ni, bool kept) {
                                                               if (!kept) s(mi, ni) = 0.f;
                                                             });
    }
    Tensor rP = convert_type<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
    gemm_rs(tiled_mma, acc_o, tOrP, tOrVt, make_tensor(tOsVt.data() + kv_offset, tOsVt.layout()), smem_copy_v,
            smem_thr_v);
  };
  // K and V are read block by block from n_block_end - 1 down to n_block_begin. Each keeps a running source tile that a
  // load reads and then steps one block down: one 64-bit add per block instead of a 64-bit multiply per
  // chunk row, and fewer registers for addresses (docs/tuning.md#running-source-tiles).
  Tensor tKgKn = tKgK(_, _, _, max(n_block_end - 1, 0));
  Tensor tVgVn = tVgV(_, _, _, max(n_block_end - 1, 0));
  const auto k_block_step = stride<3>(tKgK), v_block_step = stride<3>(tVgV);
  // A paged KV cache: a key block's rows lie in one page (page sizes are multiples of kPageRows), at its PageCursor's
  // offset from page 0's rows, where mK and mV start; the running tiles step from one block's page to the next one's.
  // Only in the 64-row tiles' kLogits instances, which the launch plan routes every paged call to (config.h:
  // fwd_tile_for; a paged call has no dropout).
  // The page of the block the K tile reads next; V's steps with it where both load together (two stages), and has a
  // cursor of its own in the one-stage loop, where V runs a block behind.
  using Page = PageCursor<kBlockN>;
  Page k_page, v_page;
  if (paged) {
    k_page = v_page = Page(p.cache, batch, max(n_block_end - 1, 0), row_lanes);
    tKgKn.data() = tKgK(_, _, _, 0).data() + k_page.offset(p.k_stride);
    tVgVn.data() = tVgV(_, _, _, 0).data() + v_page.offset(p.v_stride);
  }
  // A cursor moved from block n to n - 1 where that block is loaded next (paged); returns where it was. Not past
  // the last block: that step could cross a page and wait on the table for a block no load reads.
  auto step_page = [&](Page& cursor, int n) {
    const Page from = cursor;
    if (paged && n > n_block_begin) cursor.step_down(p.cache, batch);
    return from;
  };
  // Block n of K or V into buffer `stage`, rows >= max_row zero-filled (only where kCheckRows); then the source tile
  // steps to block n - 1 (by one block, or from page `from`'s block to page `to`'s).
  auto load_next = [&](auto check_rows, auto& tXgXn, auto block_step, Strides const& st, Page const& from,
                       Page const& to, auto const& tXsX, int stage, int max_row) {
    copy_tile<decltype(check_rows)::value>(gmem_copy, tXgXn, make_tensor(tXsX.data() + stage * kKVElems, tXsX.layout()),
                                           tKcK, max_row, p.head_dim);
    tXgXn.data() = tXgXn.data() + (paged ? to.step_from(from, st, block_step) : -block_step);
  };
  constexpr std::true_type kCut{};      // the block seqlen_k may cut
  constexpr std::false_type kWhole{};   // any other block

  // Key blocks from the last visited one down to the first: the first few and the last few are the only ones that
  // can need a mask, and the first is the only one that seqlen_k can cut.
  if (n_block_end > n_block_begin) {
    copy_tile<true>(gmem_copy, tQgQ, tQsQ, tQcQ, seq.seqlen_q - row_offset, p.head_dim);
    const int last_rows = seq.seqlen_k - (n_block_end - 1) * kBlockN;
    const auto from = step_page(k_page, n_block_end - 1);
    load_next(kCut, tKgKn, k_block_step, p.k_stride, from, k_page, tKsK, 0, last_rows);
    if constexpr (kStages == 2) load_next(kCut, tVgVn, v_block_step, p.v_stride, from, k_page, tVsV, 0, last_rows);
    cp_async_fence();
  }
  if constexpr (kStages == 2) {
    // Two buffers each: block n's K and V were loaded during block n+1, and block n-1's load into the
    // other buffers overlaps all of this block's work. One barrier per block. With kUnrollStages the loop is
    // unrolled by two, so each body's buffer is a compile-time constant (immediate ldmatrix offsets instead of
    // a per-block select); otherwise `stage` is an int that alternates.
    auto block_in_stage = [&](int n_block, auto stage) {
      Tensor acc_s = partition_fragment_C(tiled_mma, BlockS{});
      cp_async_wait<0>();
      __syncthreads();  // K[n], V[n] landed; every warp is done with block n+1, whose buffers are refilled now
      if (n_block > n_block_begin) {
        const auto from = step_page(k_page, n_block - 1);
        load_next(kWhole, tKgKn, k_block_step, p.k_stride, from, k_page, tKsK, stage ^ 1, kBlockN);
        load_next(kWhole, tVgVn, v_block_step, p.v_stride, from, k_page, tVsV, stage ^ 1, kBlockN);
        cp_async_fence();
      }
      s_gemm(acc_s, n_block, stage * kKVElems);
      softmax_pv(acc_s, n_block, stage * kKVElems);
    };
    if constexpr (Traits::kUnrollStages) {
      for (int n_block = n_block_end - 1; n_block >= n_block_begin; n_block -= 2) {
        block_in_stage(n_block, Int<0>{});
        if (n_block == n_block_begin) break;
        block_in_stage(n_block - 1, Int<1>{});
      }
    } else {
      for (int n_block = n_block_end - 1; n_block >= n_block_begin; --n_block) {
        block_in_stage(n_block, (n_block_end - 1 - n_block) & 1);
      }
    }
  } else {
    for (int n_block = n_block_end - 1; n_block >= n_block_begin; --n_block) {
      // One buffer each (FA2): V[n] streams in while S = Q K[n]^T runs; K[n-1] streams in while softmax
      // and O += P V[n] run. Every refill waits behind a barrier that proves all warps are done reading it.
      Tensor acc_s = partition_fragment_C(tiled_mma, BlockS{});
      cp_async_wait<0>();
      __syncthreads();  // K[n] (and Q) landed; all warps finished O += P V[n+1], so sV may be refilled
      const auto v_from = step_page(v_page, n_block);
      load_next(kCut, tVgVn, v_block_step, p.v_stride, v_from, v_page, tVsV, 0, seq.seqlen_k - n_block * kBlockN);
      cp_async_fence();
      s_gemm(acc_s, n_block, 0);
      cp_async_wait<0>();
      __syncthreads();  // V[n] landed; all warps finished S = Q K[n]^T, so sK may be refilled
      if (n_block > n_block_begin) {
        const auto k_from = step_page(k_page, n_block - 1);
        load_next(kWhole, tKgKn, k_block_step, p.k_stride, k_from, k_page, tKsK, 0, kBlockN);
        cp_async_fence();
      }
      softmax_pv(acc_s, n_block, 0);
    }
  }

  float lse[kRowsPerThread];
  if (splits) {
    // Split-KV: this split's O and lse in fp32, straight from registers (a decode's few rows), for fwd_combine.h,
    // which adds the sink once per row.
    softmax.finalize(acc_o, p.score_scale, nullptr, p.dropout_scale, lse);
    Tensor o = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));
    Tensor c = make_tensor(tOcO.data(), rowcol_layout(tOcO.layout()));
    const int64_t split_row0 = split * p.lse_rows + seq.stats_row + row_offset;
    CUTE_UNROLL
    for (int mi = 0; mi < kRowsPerThread; ++mi) {
      const int row = get<0>(c(mi, 0));
      if (row >= seq.seqlen_q - row_offset) continue;
      if (get<1>(c(0, 0)) == 0) p.lse_partial[split_row0 + row] = lse[mi];
      float* o_row = p.o_partial + (split_row0 + row) * p.head_dim;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(o); ++ni) {
        const int col = get<1>(c(mi, ni));
        if (col < p.head_dim) o_row[col] = o(mi, ni);
      }
    }
    return;
  }

  // Epilogue: normalise, write lse, stage O through shared memory for 16-byte coalesced stores.
  softmax.finalize(acc_o, p.score_scale, p.sink == nullptr ? nullptr : p.sink + head, p.dropout_scale, lse);
  {
    Tensor c = make_tensor(tOcO.data(), rowcol_layout(tOcO.layout()));
    float* lse_row = p.lse + seq.stats_row + row_offset;
    CUTE_UNROLL
    for (int mi = 0; mi < kRowsPerThread; ++mi) {
      const int row = get<0>(c(mi, 0));
      if (get<1>(c(0, 0)) == 0 && row < seq.seqlen_q - row_offset) lse_row[row] = lse[mi];
    }
  }

  Tensor rO = convert_type<Element>(acc_o);
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomOut{}, tiled_mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(tid);
  Tensor taccOrO = smem_thr_o.retile_S(rO);
  Tensor taccOsO = smem_thr_o.partition_D(sO);
  __syncthreads();  // every warp is done reading sQ before it is overwritten with O
  copy(smem_copy_o, taccOrO, taccOsO);
  __syncthreads();

  typename Traits::GmemTiledCopyOut gmem_copy_o;
  auto gmem_thr_o = gmem_copy_o.get_thread_slice(tid);
  Tensor mO = seq.q_tensor<kHeadDim, Element>(p.o, p.o_stride, batch, head);
  Tensor gO = local_tile(mO, BlockQ{}, make_coord(m_block, 0));
  Tensor tOsO = gmem_thr_o.partition_S(sO);
  Tensor tOgO = gmem_thr_o.partition_D(gO);
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  copy(gmem_copy_o, tOsO, tOrO);
  store_tile(gmem_copy_o, tOrO, tOgO, tQcQ, seq.seqlen_q - row_offset, p.head_dim);
}

}  // namespace fa2
