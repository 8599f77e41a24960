// FlashAttention-2 backward (reference.py: flash_bwd_tiled): the two main loops. The launch (bwd_launch.h) runs
//   bwd_preprocess_kernel: D = rowsum(dO * O), and zero the fp32 dQ accumulator (bwd_row_kernels.h)
//   bwd_kernel:            per K/V block, walk the query blocks: recompute P from lse,
//                          dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dK += dS^T Q, dQ += dS K (atomics)
//   bwd_convert_dq_kernel: dQ = softmax_scale * dQ_accum, in the input dtype (bwd_row_kernels.h)
// With deterministic=true, bwd_kernel skips dQ and bwd_dq_kernel computes it instead: one CTA per query
// block walks the key blocks in order, recomputing P and dS, so no two CTAs add into the same dQ row.
// One tile's math is in bwd_tile.h, the dQ atomics in dq_accum.h, the shared-memory map in bwd_smem.h.
// Names follow CuTe: g* global, s* shared, r* registers; tXsY is tensor Y partitioned for operation X
// (tS: S and dP, tdV / tdK: the dV and dK GEMMs, tdQ: the dQ GEMM).
#pragma once

#include <cute/tensor.hpp>

#include "sm80/bwd_smem.h"
#include "sm80/bwd_tile.h"
#include "sm80/config.h"
#include "sm80/dq_accum.h"
#include "sm80/mask.h"
#include "common/params.h"
#include "common/schedule.h"
#include "common/seqlen.h"
#include "sm80/utils.h"

namespace fa2 {
using namespace cute;

// dK, dV (and, unless deterministic, dQ through atomics) for one key block.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(const __grid_constant__ BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  using BlockQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using BlockKV = Shape<Int<kBlockN>, Int<kHeadDim>>;

  // Causal: key block 0 is seen by every query, so the heaviest blocks of a head group go first (schedule.h).
  const BlockHead work = scheduled_block</*kHeavyLast=*/false>(p);
  const int n_block = work.block, head = work.head;
  const int batch = blockIdx.z;
  const int head_kv = head / (p.nheads / p.nheads_k);
  const int tid = threadIdx.x;
  const int col_offset = n_block * kBlockN;
  const SeqInfo seq(p, batch, head);
  if (col_offset >= seq.seqlen_k) return;  // varlen: the grid is sized for the longest sequence
  // Query blocks that see at least one key of this block (mask.h).
  const int2 m_blocks = query_blocks<kBlockM, kBlockN>(p, n_block, seq.seqlen_q, seq.seqlen_k);
  const int m_block_begin = m_blocks.x, m_block_end = m_blocks.y;
  const UnmaskedRows unmasked =
      unmasked_rows(p, Traits::kBlockMSdP, col_offset, kBlockN, seq.seqlen_q, seq.seqlen_k);
  const float alibi = alibi_slope(p, batch, head);
  const DropoutDraw draw(p, batch, head);

  Tensor gQ = local_tile(seq.q_tensor<kHeadDim, const Element>(p.q, p.q_stride, batch, head), BlockQ{},
                         make_coord(_, 0));  // (kBlockM, kHeadDim, m_blocks)
  Tensor gdO = local_tile(seq.q_tensor<kHeadDim, const Element>(p.dout, p.dout_stride, batch, head), BlockQ{},
                          make_coord(_, 0));
  Tensor gK = local_tile(seq.k_tensor<kHeadDim, const Element>(p.k, p.k_stride, batch, head_kv), BlockKV{},
                         make_coord(n_block, 0));
  Tensor gV = local_tile(seq.k_tensor<kHeadDim, const Element>(p.v, p.v_stride, batch, head_kv), BlockKV{},
                         make_coord(n_block, 0));
  const float* lse = p.lse + seq.stats_row;
  const float* d_sum = p.d_sum + seq.stats_row;
  float* dq_accum = p.dq_accum + seq.stats_row * p.head_dim;

  extern __shared__ char smem_raw[];
  BwdSmem<Traits> smem(smem_raw);
  Tensor sK = smem.tensor(smem.k(), typename Traits::SmemLayoutKV{});
  Tensor sV = smem.tensor(smem.v(), typename Traits::SmemLayoutKV{});
  Tensor sKt = smem.tensor(smem.k(), typename Traits::SmemLayoutKt{});
  Tensor sP = smem.tensor(smem.p(), typename Traits::SmemLayoutPdS{});
  Tensor sdS = smem.tensor(smem.ds(), typename Traits::SmemLayoutPdS{});
  Tensor sPt = smem.tensor(smem.p(), typename Traits::SmemLayoutPdSt{});
  Tensor sdSt = smem.tensor(smem.ds(), typename Traits::SmemLayoutPdSt{});

  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);  // (CPY, CPY_M, CPY_K, m_blocks)
  Tensor tQgdO = gmem_thr.partition_S(gdO);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(BlockQ{}));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(BlockKV{}));
  // Query blocks are loaded in order from m_block_begin up. Where Traits::kRunningQdO, Q and dO each keep a running
  // source tile that a load reads and then steps one block on (one 64-bit add per block instead of a 64-bit multiply
  // per chunk row, as in the forward); else each load indexes its block afresh. Per head dim (bwd_launch.h). The two
  // branches below are spelled out: sharing one copy lambda changed ptxas's schedule of the indexed form (d96 SASS).
  Tensor tQgQn = tQgQ(_, _, _, m_block_begin);
  Tensor tQgdOn = tQgdO(_, _, _, m_block_begin);
  const auto q_block_step = stride<3>(tQgQ), do_block_step = stride<3>(tQgdO);
  auto load_q_do = [&](int m_block, int stage) {  // m_block: the block after the last one loaded
    const int rows = seq.seqlen_q - m_block * kBlockM;
    Tensor tQsQ = gmem_thr.partition_D(smem.tensor(smem.q(stage), typename Traits::SmemLayoutQdO{}));
    Tensor tQsdO = gmem_thr.partition_D(smem.tensor(smem.dout(stage), typename Traits::SmemLayoutQdO{}));
    // Whole blocks (all but the last, when head_dim is a compiled size) skip the per-chunk row/column tests, as
    // the dQ atomics below do: fewer predicates and branches per block (docs/tuning.md#whole-block-fast-path).
    const bool whole = rows >= kBlockM && p.head_dim == kHeadDim;
    if constexpr (Traits::kRunningQdO) {
      if (whole) {
        copy(gmem_copy, tQgQn, tQsQ);
        copy(gmem_copy, tQgdOn, tQsdO);
      } else {
        copy_tile<true>(gmem_copy, tQgQn, tQsQ, tQcQ, rows, p.head_dim);
        copy_tile<true>(gmem_copy, tQgdOn, tQsdO, tQcQ, rows, p.head_dim);
      }
      tQgQn.data() = tQgQn.data() + q_block_step;
      tQgdOn.data() = tQgdOn.data() + do_block_step;
    } else if (whole) {
      copy(gmem_copy, tQgQ(_, _, _, m_block), tQsQ);
      copy(gmem_copy, tQgdO(_, _, _, m_block), tQsdO);
    } else {
      copy_tile<true>(gmem_copy, tQgQ(_, _, _, m_block), tQsQ, tQcQ, rows, p.head_dim);
      copy_tile<true>(gmem_copy, tQgdO(_, _, _, m_block), tQsdO, tQcQ, rows, p.head_dim);
    }
  };

  // dV += P^T dO and dK += dS^T Q: P, dS, Q and dO are all read transposed (ldmatrix.trans).
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto copy_a_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomT{}, mma_dkv);
  auto copy_b_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dkv);
  auto thr_a_dkv = copy_a_dkv.get_thread_slice(tid);
  auto thr_b_dkv = copy_b_dkv.get_thread_slice(tid);
  Tensor tdKVrA = thr_dkv.partition_fragment_A(fragment_shape<Element, kBlockN, kBlockM>());
  Tensor tdKVrB = thr_dkv.partition_fragment_B(fragment_shape<Element, kHeadDim, kBlockM>());
  Tensor tdVsPt = thr_a_dkv.partition_S(sPt);
  Tensor tdKsdSt = thr_a_dkv.partition_S(sdSt);
  Tensor acc_dk = partition_fragment_C(mma_dkv, BlockKV{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, BlockKV{});
  clear(acc_dk);
  clear(acc_dv);

  typename Traits::TiledMmadQ mma_dq;
  Tensor tdQcdQ = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(BlockQ{}));

  auto load_kv = [&](auto const& gX, auto& sX) {
    copy_tile<true>(gmem_copy, gmem_thr.partition_S(gX), gmem_thr.partition_D(sX), tKcK, seq.seqlen_k - col_offset,
                    p.head_dim);
  };
  if (m_block_begin < m_block_end) {
    load_kv(gK, sK);
    load_kv(gV, sV);
    load_q_do(m_block_begin, 0);
    cp_async_fence();
  }

  for (int m_block = m_block_begin; m_block < m_block_end; ++m_block) {
    const int stage = kStages == 2 ? (m_block - m_block_begin) % 2 : 0;
    const int row_offset = m_block * kBlockM;
    Tensor sQ = smem.tensor(smem.q(stage), typename Traits::SmemLayoutQdO{});
    Tensor sdO = smem.tensor(smem.dout(stage), typename Traits::SmemLayoutQdO{});
    Tensor sQt = smem.tensor(smem.q(stage), typename Traits::SmemLayoutQdOt{});
    Tensor sdOt = smem.tensor(smem.dout(stage), typename Traits::SmemLayoutQdOt{});

    cp_async_wait<0>();
    __syncthreads();  // Q[m], dO[m] (and K, V) landed; every warp is done with the previous sP / sdS / stage
    if (kStages == 2 && m_block + 1 < m_block_end) {
      load_q_do(m_block + 1, stage ^ 1);  // lands while this block's five GEMMs run
      cp_async_fence();
    }

    bwd_p_ds_block<Traits>(p, sQ, sdO, sK, sV, sP, sdS, lse, d_sum, alibi, draw, unmasked, row_offset, col_offset,
                           seq.seqlen_q, seq.seqlen_k);
    __syncthreads();  // sP and sdS complete: every warp reads all of them below

    // This key block's share of dQ, added into the fp32 accumulator (softmax_scale applied later).
    auto dq_step = [&] {
      if (p.deterministic) return;
      Tensor acc_dq = partition_fragment_C(mma_dq, BlockQ{});
      clear(acc_dq);
      bwd_dq_tile<Traits>(acc_dq, sdS, sKt);
      if (row_offset + kBlockM <= seq.seqlen_q && p.head_dim == kHeadDim) {  // whole block: no bounds tests
        add_dq_to_accum<Traits, false>(acc_dq, tdQcdQ, dq_stage(smem), dq_accum, row_offset,
                                       seq.seqlen_q, p);
      } else {
        add_dq_to_accum<Traits, true>(acc_dq, tdQcdQ, dq_stage(smem), dq_accum, row_offset,
                                      seq.seqlen_q, p);
      }
    };
    // dQ before or after the dK GEMM: config.h (dq_before_dk).
    constexpr bool kDqBeforeDk = dq_before_dk(dq_path<Traits>());
    gemm_ss(mma_dkv, acc_dv, tdKVrA, tdKVrB, tdVsPt, thr_b_dkv.partition_S(sdOt), copy_a_dkv, copy_b_dkv, thr_a_dkv,
            thr_b_dkv);
    if constexpr (kDqBeforeDk) dq_step();
    gemm_ss(mma_dkv, acc_dk, tdKVrA, tdKVrB, tdKsdSt, thr_b_dkv.partition_S(sQt), copy_a_dkv, copy_b_dkv, thr_a_dkv,
            thr_b_dkv);
    if constexpr (!kDqBeforeDk) dq_step();

    if (kStages == 1 && m_block + 1 < m_block_end) {
      __syncthreads();  // every warp is done reading sQ and sdO (and sP, sdS where they took V's bytes)
      if constexpr (Traits::kPdSInV) load_kv(gV, sV);
      load_q_do(m_block + 1, 0);
      cp_async_fence();
    }
  }

  // dK = softmax_scale * dS^T Q and dV, staged through sK / sV (free once every warp is past the loop).
  auto out_tile = [&](void* base, Strides const& st) {
    return local_tile(seq.k_tensor<kHeadDim, Element>(base, st, batch, head), BlockKV{}, make_coord(n_block, 0));
  };
  if (p.dkv_fp32) {
    // fp32 slices straight from registers: each thread's column pairs become 8-byte stores.
    Tensor coord = thr_dkv.partition_C(make_identity_tensor(BlockKV{}));
    auto store_fp32 = [&](auto& acc, void* base, Strides const& st, float scale) {
      float* ptr = &seq.k_tensor<kHeadDim, float>(base, st, batch, head)(col_offset, 0);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); i += 2) {  // (i, i+1) are columns (c, c+1) of one row
        const int r = get<0>(coord(i)), c = get<1>(coord(i));
        if (r < seq.seqlen_k - col_offset && c < p.head_dim) {
          *reinterpret_cast<float2*>(ptr + r * st.row + c) = make_float2(acc(i) * scale, acc(i + 1) * scale);
        }
      }
    };
    store_fp32(acc_dk, p.dk, p.dk_stride, p.softmax_scale);
    store_fp32(acc_dv, p.dv, p.dv_stride, 1.f);
    return;
  }
  Tensor gdK = out_tile(p.dk, p.dk_stride);
  Tensor gdV = out_tile(p.dv, p.dv_stride);
  __syncthreads();
  store_acc_tile<Traits>(mma_dkv, acc_dk, p.softmax_scale, sK, gdK, seq.seqlen_k - col_offset, p.head_dim);
  store_acc_tile<Traits>(mma_dkv, acc_dv, 1.f, sV, gdV, seq.seqlen_k - col_offset, p.head_dim);
}

// Deterministic dQ: one query block per CTA, key blocks visited in a fixed order, no atomics.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_dq_kernel(const __grid_constant__ BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using BlockQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using BlockKV = Shape<Int<kBlockN>, Int<kHeadDim>>;

  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int head_kv = head / (p.nheads / p.nheads_k);
  const int tid = threadIdx.x;
  const int row_offset = m_block * kBlockM;
  const SeqInfo seq(p, batch, head);
  if (row_offset >= seq.seqlen_q) return;
  const KeyBlocks n_blocks = key_blocks<kBlockM, kBlockN>(p, m_block, seq.seqlen_q, seq.seqlen_k);
  const float alibi = alibi_slope(p, batch, head);
  const DropoutDraw draw(p, batch, head);

  Tensor gQ = local_tile(seq.q_tensor<kHeadDim, const Element>(p.q, p.q_stride, batch, head), BlockQ{},
                         make_coord(m_block, 0));
  Tensor gdO = local_tile(seq.q_tensor<kHeadDim, const Element>(p.dout, p.dout_stride, batch, head), BlockQ{},
                          make_coord(m_block, 0));
  Tensor gK = local_tile(seq.k_tensor<kHeadDim, const Element>(p.k, p.k_stride, batch, head_kv), BlockKV{},
                         make_coord(_, 0));  // (kBlockN, kHeadDim, n_blocks)
  Tensor gV = local_tile(seq.k_tensor<kHeadDim, const Element>(p.v, p.v_stride, batch, head_kv), BlockKV{},
                         make_coord(_, 0));

  extern __shared__ char smem_raw[];
  BwdSmem<Traits> smem(smem_raw);
  Tensor sQ = smem.tensor(smem.q(0), typename Traits::SmemLayoutQdO{});
  Tensor sdO = smem.tensor(smem.dout(0), typename Traits::SmemLayoutQdO{});
  Tensor sK = smem.tensor(smem.k(), typename Traits::SmemLayoutKV{});
  Tensor sV = smem.tensor(smem.v(), typename Traits::SmemLayoutKV{});
  Tensor sKt = smem.tensor(smem.k(), typename Traits::SmemLayoutKt{});
  Tensor sP = smem.tensor(smem.p(), typename Traits::SmemLayoutPdS{});
  Tensor sdS = smem.tensor(smem.ds(), typename Traits::SmemLayoutPdS{});

  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(BlockQ{}));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(BlockKV{}));
  Tensor tKgK = gmem_thr.partition_S(gK);
  Tensor tKgV = gmem_thr.partition_S(gV);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tKsV = gmem_thr.partition_D(sV);
  copy_tile<true>(gmem_copy, gmem_thr.partition_S(gQ), gmem_thr.partition_D(sQ), tQcQ, seq.seqlen_q - row_offset,
                  p.head_dim);
  copy_tile<true>(gmem_copy, gmem_thr.partition_S(gdO), gmem_thr.partition_D(sdO), tQcQ, seq.seqlen_q - row_offset,
                  p.head_dim);

  typename Traits::TiledMmadQ mma_dq;
  Tensor acc_dq = partition_fragment_C(mma_dq, BlockQ{});
  clear(acc_dq);
  for (int n_block = n_blocks.begin; n_block < n_blocks.end; ++n_block) {
    const int col_offset = n_block * kBlockN;
    __syncthreads();  // every warp is done reading the previous sK / sV / sdS
    copy_tile<true>(gmem_copy, tKgK(_, _, _, n_block), tKsK, tKcK, seq.seqlen_k - col_offset, p.head_dim);
    copy_tile<true>(gmem_copy, tKgV(_, _, _, n_block), tKsV, tKcK, seq.seqlen_k - col_offset, p.head_dim);
    cp_async_fence();
    cp_async_wait<0>();
    __syncthreads();
    const UnmaskedRows unmasked =
        unmasked_rows(p, Traits::kBlockMSdP, col_offset, kBlockN, seq.seqlen_q, seq.seqlen_k);
    bwd_p_ds_block<Traits>(p, sQ, sdO, sK, sV, sP, sdS, p.lse + seq.stats_row, p.d_sum + seq.stats_row, alibi,
                           draw, unmasked, row_offset, col_offset, seq.seqlen_q, seq.seqlen_k);
    __syncthreads();
    bwd_dq_tile<Traits>(acc_dq, sdS, sKt);
  }

  Tensor gdQ = local_tile(seq.q_tensor<kHeadDim, Element>(p.dq, p.dq_stride, batch, head), BlockQ{},
                          make_coord(m_block, 0));
  // sQ is reused to stage dQ. A block that saw no key skipped the loop, so its Q/dO copies may still be
  // in flight: drain them first.
  cp_async_wait<0>();
  __syncthreads();
  store_acc_tile<Traits>(mma_dq, acc_dq, p.softmax_scale, sQ, gdQ, seq.seqlen_q - row_offset, p.head_dim);
}

}  // namespace fa2
