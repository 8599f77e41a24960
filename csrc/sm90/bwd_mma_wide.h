// The d256 tile's MMA warpgroups (config.h: bwd_tile(256); FA3's mainloop_bwd_sm90_tma_gmma_ws.hpp at hdim 256): per
// query block that sees this CTA's 64 keys, S and dP, P and dS through shared memory, dV^T and dK^T with the head dim
// split across the warpgroups, and dQ per 128-column half, staged for the dQ writer warp's TMA reduce-add
// (bwd_dq_stage.h); then dK and dV to global memory. bwd_kernel.h runs the prologue, the producer and the writer.
//                                                                                      docs/tuning.md#sm90-backward
// Names as in bwd_kernel.h; here tSr is of S = Q K^T, tdPr of dP = dO V^T, tdVr / tdKr of dV^T, dK^T.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

#include "sm90/bwd_dq_stage.h"
#include "sm90/bwd_traits.h"
#include "sm90/seq_rows.h"
#include "sm90/utils.h"

namespace fa2::sm90 {
using namespace cute;

// Half kH of a register tile along mode 1 (dV^T's and dK^T's MMA_M repeats: dims [0, 128) or [128, 256); dQ's B
// operand's MMA_N repeats: K^T's 128-column halves), keeping the rank warpgroup_gemm iterates over.
template <int kH, class T>
__device__ __forceinline__ auto half_slice(T&& t) {
  return logical_divide(t, Shape<Underscore, _2>{})(_, make_coord(Int<kH>{}, _), _);
}

// The MMA warpgroups' named barrier (ids 1-4 are dQ's staging, bwd_dq_stage.h). With one P and one dS stage it
// separates, per query block: the previous block's last readers (dV^T, dQ, dK^T) from the P writes, the P writes from
// dV^T's reads (each warpgroup's dV^T reads all 64 keys), the dS writes from dQ's and dK^T's reads.
constexpr int kPdSBarrier = 0;

// w: the tile (bwd_kernel.h's BwdWork): its key block, walk, batch and the query blocks it walks, in the producer's
// order.
template <class Traits, class Work>
__device__ __forceinline__ void bwd_mma_wide(BwdKernelParams<Traits> const& p, typename Traits::SharedStorage& shared,
                                             typename Traits::Pipeline& q_pipe, typename Traits::PipelinedO& do_pipe,
                                             Work const& w) {
  const int n_block = w.n_block, batch = w.batch, m_begin = w.m_begin, m_end = w.m_end;
  const SeqRows seq = seq_rows(p, batch);  // its lengths; a packed sequence's first key
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, diagonal = seqlen_k - seqlen_q;
  using Element = typename Traits::Element;
  using M = typename Traits::M;
  using N = typename Traits::N;
  using D = typename Traits::D;
  using dQCols = Int<Traits::kdQCols>;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static_assert(Traits::kWide && Traits::kStagesdO == 1 && Traits::kStagesdS == 2 && 2 * Traits::kdQCols == kHeadDim);
  const int tid = threadIdx.x - kWarpgroupThreads, mma_warpgroup = tid / kWarpgroupThreads;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<D, N>{});  // dK^T: 2 x 64 dims x 64 keys a warpgroup
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<D, N>{});
  clear(tdKrdK);
  clear(tdVrdV);

  if (m_begin < m_end) {
    // Stands in for the writer's first "empty": the slab starts free (bwd_kernel.h's dQ writer).
    if (tid % kWarpgroupThreads < 32) cutlass::arch::NamedBarrier::arrive(kdQThreads, kdQEmpty + mma_warpgroup);
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});      // (M, d, stages)
    Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQt{});    // (d, M, stages)
    Tensor sdO = make_tensor(make_smem_ptr(shared.dO.data()), typename Traits::SmemLayoutdO{});   // (M, d, 1)
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dO.data()), typename Traits::SmemLayoutdOt{}); // (d, M, 1)
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});      // (N, d)
    Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKt{});    // (d, N)
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});      // (N, d)
    // dS in stage 0 of its buffer, P in stage 1.
    Tensor sdS = make_tensor(make_smem_ptr(shared.dS.data()), typename Traits::SmemLayoutdS{});    // (M, N, 2)
    Tensor sdSt = make_tensor(make_smem_ptr(shared.dS.data()), typename Traits::SmemLayoutdSt{});  // (N, M, 2)
    // Operands: Q and dO are S's and dP's A (M = queries), K and V their B (N = keys); dO^T and Q^T are dV^T's and
    // dK^T's A (M = d), P^T and dS^T their B (N = keys, K = queries); dS and K^T are dQ's A and B.
    Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
    Tensor tSrK = thr_sdp.partition_fragment_B(sK);
    Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
    Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
    Tensor tdVrdO = thr_dkv.partition_fragment_A(sdOt);
    Tensor tdVrP = thr_dkv.partition_fragment_B(sdSt);
    Tensor tdKrQ = thr_dkv.partition_fragment_A(sQt);
    Tensor tdKrdS = thr_dkv.partition_fragment_B(sdSt);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
    Tensor tdQrK = thr_dq.partition_fragment_B(sKt);  // (.., 2 halves of d, keys)
    auto dV0 = half_slice<0>(tdVrdV);
    auto dV1 = half_slice<1>(tdVrdV);
    auto dK0 = half_slice<0>(tdKrdK);
    auto dK1 = half_slice<1>(tdKrdK);
    // P and dS registers -> shared memory, as they are (stmatrix).
    auto r2s = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, mma_sdp);
    auto thr_r2s = r2s.get_thread_slice(tid);
    Tensor tPsP = thr_r2s.partition_D(as_position_independent_swizzle_tensor(sdS(_, _, 1)));
    Tensor tdSsdS = thr_r2s.partition_D(as_position_independent_swizzle_tensor(sdS(_, _, 0)));
    // The (query, key) of each S register.
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<M, N>{}));
    Tensor cS_rc = make_tensor(cS.data(), rowcol(cS.layout()));  // (queries, keys)
    constexpr int kRows = decltype(size<0>(cS_rc))::value;       // queries per thread
    // The walk's head's first row in the stats box: each next head's starts stats_head_rows rows later.
    int stats_shift = stats_row<true>(p, seq, batch, w.head) & 3;

    shared.kv_full.wait(0);
    typename Traits::PipelineState stage;
    typename Traits::PipelineStatedO do_stage;
    for (int i = 0, m = w.m_first; i < w.steps; ++i, m = w.next(m),
             stats_shift = (stats_shift + (w.new_head(m) ? p.stats_head_rows : 0)) & 3, ++stage, ++do_stage) {
      const int s = stage.index(), query0 = m * kBlockM, key0 = n_block * kBlockN;
      // S = Q K^T and dP = dO V^T, both in flight; P's exp2 overlaps dP's GEMM.
      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<M, N>{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<M, N>{});
      q_pipe.consumer_wait(stage);
      warpgroup_gemm<true, -1>(mma_sdp, tSrQ(_, _, _, s), tSrK, tSrS);
      // lse of this thread's queries, as bwd_kernel.h reads it (rows past seqlen_q and rows that saw no key: P = 0).
      const float* lse_s = shared.lse.data() + s * Traits::kStatsStage + stats_shift;
      float lse_log2[kRows];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const int row = get<0>(cS_rc(mi, 0));
        const float l = query0 + row < seqlen_q ? lse_s[row] : INFINITY;
        lse_log2[mi] = l == -INFINITY ? INFINITY : l * float(M_LOG2E);
      }
      do_pipe.consumer_wait(do_stage);
      warpgroup_gemm<true, -1>(mma_sdp, tdPrdO(_, _, _, 0), tdPrV, tdPrdP);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      // P = exp2(S * scale_log2 - lse * log2(e)) (reference: p = exp(s * scale - lse)), masked past seqlen_k and,
      // causal, past a query's diagonal.
      Tensor scores = make_tensor(tSrS.data(), rowcol(tSrS.layout()));  // (queries, keys)
      const bool edge = key0 + kBlockN > seqlen_k || (p.causal && key0 + kBlockN - 1 > query0 + diagonal);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(scores); ++ni) {
          scores(mi, ni) = exp2f(scores(mi, ni) * p.scale_log2 - lse_log2[mi]);
        }
      }
      if (edge) {
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(scores); ++ni) {
            const int query = query0 + get<0>(cS_rc(mi, ni)), key = key0 + get<1>(cS_rc(mi, ni));
            if (key >= seqlen_k || (p.causal && key > query + diagonal)) scores(mi, ni) = 0.f;
          }
        }
      }
      const float* d_s = shared.d.data() + do_stage.index() * Traits::kStatsStage + stats_shift;
      float d_row[kRows];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const int row = get<0>(cS_rc(mi, 0));
        d_row[mi] = query0 + row < seqlen_q ? d_s[row] : 0.f;
      }
      Tensor rP = make_tensor<Element>(tSrS.layout());
      convert(tSrS, rP);
      // P -> sdS[1] once both warpgroups' readers of the previous block (dV^T of P; dQ and dK^T of dS) have retired:
      // each waited for all its GEMMs before releasing Q.
      cutlass::arch::NamedBarrier::sync(Traits::kMmaThreads, kPdSBarrier);
      copy(r2s, thr_r2s.retile_S(rP), tPsP);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tdPrdP);
      // dS = P * (dP - D) (reference: ds = p * (dp - D)), in dP's registers.
      Tensor ds = make_tensor(tdPrdP.data(), scores.layout());
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(ds); ++ni) ds(mi, ni) = scores(mi, ni) * (ds(mi, ni) - d_row[mi]);
      }
      Tensor rdS = make_tensor<Element>(tdPrdP.layout());
      convert(tdPrdP, rdS);
      // P visible to the async proxy (wgmma reads shared memory through it) and complete from both warpgroups.
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(Traits::kMmaThreads, kPdSBarrier);
      copy(r2s, thr_r2s.retile_S(rdS), tdSsdS);
      // dV^T += dO^T P, this warpgroup's first 64 dims, while the dS stores drain.
      warpgroup_gemm<false, -1>(mma_dkv, half_slice<0>(tdVrdO(_, _, _, 0)), tdVrP(_, _, _, 1), dV0);
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(Traits::kMmaThreads, kPdSBarrier);  // dS complete
      // dQ = dS K by halves into the same 32 registers; each half's staging overlaps the dV^T / dK^T GEMM issued after
      // it. Order: dQ0, dV^T1 | stage dQ0 | dK^T0 | dO free | dQ1, dK^T1 | stage dQ1 | Q free (FA3's, except that dK^T1
      // is issued before dQ1's staging rather than after, so that it overlaps it too).
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<M, dQCols>{});
      warpgroup_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, 0), half_slice<0>(tdQrK), tdQrdQ);
      warpgroup_gemm<false, 1>(mma_dkv, half_slice<1>(tdVrdO(_, _, _, 0)), tdVrP(_, _, _, 1), dV1);  // dQ0 retired
      warpgroup_fence_operand(tdQrdQ);
      hand_dq_to_writer<Traits>(mma_dq, tid, tdQrdQ, shared.dq.data(), mma_warpgroup);
      warpgroup_gemm<false, 1>(mma_dkv, half_slice<0>(tdKrQ(_, _, _, s)), tdKrdS(_, _, _, 0), dK0);  // dV^T1 retired
      do_pipe.consumer_release(do_stage);  // dV^T's GEMMs, dO's last readers, retired
      warpgroup_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, 0), half_slice<1>(tdQrK), tdQrdQ);
      warpgroup_gemm<false, 1>(mma_dkv, half_slice<1>(tdKrQ(_, _, _, s)), tdKrdS(_, _, _, 0), dK1);  // dQ1 retired
      warpgroup_fence_operand(tdQrdQ);
      hand_dq_to_writer<Traits>(mma_dq, tid, tdQrdQ, shared.dq.data(), mma_warpgroup);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tdKrdK);
      q_pipe.consumer_release(stage);  // dK^T's GEMMs, Q's last readers, retired
    }
  }

  // ------------------------------------------------------------------------------------------ epilogue
  // dK = softmax_scale * sum Q^T dS, transposed (reference: dk = scale * ds^T q), and dV, for this walk's slice;
  // keys past seqlen_k are not written (a packed sequence's rows from its first key). The registers hold (dims, keys),
  // a thread's pairs two keys of one dim; lanes l and l ^ 4 hold neighbouring dims at the same keys, so one swap gives
  // each a pair of dims at one key, written as bwd_kernel.h writes them (Element pairs, or fp32 pairs where the host
  // sums a group's walks afterwards).
  Tensor cKV = thr_dkv.partition_C(make_identity_tensor(Shape<D, N>{}));
  Tensor cKV_rc = make_tensor(cKV.data(), rowcol(cKV.layout()));  // (dims, keys)
  Tensor dk = make_tensor(tdKrdK.data(), rowcol(tdKrdK.layout()));
  Tensor dv = make_tensor(tdVrdV.data(), rowcol(tdVrdV.layout()));
  const int slice = w.head / p.walk_heads;
  const int64_t dk_base = batch * p.dk_batch_stride + seq.k_start * p.dk_row_stride + slice * p.dk_head_stride;
  const int64_t dv_base = batch * p.dv_batch_stride + seq.k_start * p.dv_row_stride + slice * p.dv_head_stride;
  const int upper = (threadIdx.x >> 2) & 1;  // this lane holds the odd dim of its pair
  cutlass::NumericArrayConverter<Element, float, 2> cvt;
  CUTE_UNROLL
  for (int c = 0; c < size<1>(dk); c += 2) {
    const int key = n_block * kBlockN + get<1>(cKV_rc(0, c)) + upper;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(dk); ++r) {
      const float k_got = __shfl_xor_sync(0xffffffff, upper ? dk(r, c) : dk(r, c + 1), 4);
      const float v_got = __shfl_xor_sync(0xffffffff, upper ? dv(r, c) : dv(r, c + 1), 4);
      if (key >= seqlen_k) continue;
      const int col = get<0>(cKV_rc(r, c)) - upper;
      const int64_t k_off = dk_base + key * p.dk_row_stride + col, v_off = dv_base + key * p.dv_row_stride + col;
      cutlass::Array<float, 2> k2, v2;
      k2[0] = (upper ? k_got : dk(r, c)) * p.softmax_scale, k2[1] = (upper ? dk(r, c + 1) : k_got) * p.softmax_scale;
      v2[0] = upper ? v_got : dv(r, c), v2[1] = upper ? dv(r, c + 1) : v_got;
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

}  // namespace fa2::sm90
