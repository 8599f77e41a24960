// The backward's work on one (query block, key block) tile, shared by both main loops (bwd_kernel.h): S, P, dP
// and dS into shared memory (bwd_p_ds, bwd_p_ds_block), the dQ GEMM (bwd_dq_tile), and the epilogue that stores an
// accumulator tile through shared memory (store_acc_tile). The operand layouts and warp arrangements are the
// Traits' (traits.h).
#pragma once

#include <cmath>
#include <type_traits>
#include <cute/tensor.hpp>

#include "sm80/dropout.h"
#include "sm80/mask.h"
#include "common/params.h"
#include "sm80/utils.h"

namespace fa2 {
using namespace cute;

// Register fragments are shaped by a plain row-major (rows, cols) layout; no memory behind it.
template <typename Element, int kRows, int kCols>
__device__ __forceinline__ auto fragment_shape() {
  return make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                     make_layout(Shape<Int<kRows>, Int<kCols>>{}, GenRowMajor{}));
}

// One (query block, key block) tile, shared by both kernels: S = Q K^T (softcap: tanh(Q K^T * softcap_in)),
// P = exp2(S*scale_log2 - lse*log2e) (the forward's probabilities, recomputed), dP = dO V^T, dS = P * (dP - D)
// (softcap: times tanh's derivative); P and dS are written to shared memory. The caller synchronises before
// reading sP / sdS. With dropout (Z kept, 1/(1-p) = dropout_scale): sP = P Z / (1-p) for dV, and
// dS = P (Z dP / (1-p) - D), D = rowsum(dO O) being unchanged. `mask`: the tile may hold scores outside the band or
// past seqlen_k (UnmaskedRows, mask.h).
template <typename Traits, typename SmemQ, typename SmemKV, typename SmemPdS>
__device__ __forceinline__ void bwd_p_ds(BwdParams const& p, SmemQ const& sQ, SmemQ const& sdO, SmemKV const& sK,
                                         SmemKV const& sV, SmemPdS& sP, SmemPdS& sdS, const float* lse,
                                         const float* d_sum, float alibi, DropoutDraw const& draw, bool mask,
                                         int row_offset, int col_offset, int seqlen_q, int seqlen_k) {
  using Element = typename Traits::Element;
  using BlockS = Shape<Int<Traits::kBlockMSdP>, Int<Traits::kBlockN>>;
  const int tid = threadIdx.x;
  typename Traits::TiledMmaSdP mma;
  auto thr_mma = mma.get_thread_slice(tid);
  auto copy_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma);
  auto copy_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma);
  auto thr_a = copy_a.get_thread_slice(tid);
  auto thr_b = copy_b.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(fragment_shape<Element, Traits::kBlockMSdP, Traits::kHeadDim>());
  Tensor tSrK = thr_mma.partition_fragment_B(fragment_shape<Element, Traits::kBlockN, Traits::kHeadDim>());
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(BlockS{}));

  // lse and D of the rows this thread owns. Rows past seqlen_q, and rows that saw no key in the forward
  // (lse = -inf), get lse = +inf so that P = 0 there.
  Tensor c = make_tensor(tScS.data(), rowcol_layout(tScS.layout()));
  constexpr int kRows = decltype(size<0>(c))::value;
  float lse_log2[kRows], d_row[kRows];
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const int row = row_offset + get<0>(c(mi, 0));
    const float l = row < seqlen_q ? lse[row] : INFINITY;
    lse_log2[mi] = l == -INFINITY ? INFINITY : l * float(M_LOG2E);
    d_row[mi] = row < seqlen_q ? d_sum[row] : 0.f;
  }

  Tensor acc_s = partition_fragment_C(mma, BlockS{});
  clear(acc_s);
  gemm_ss(mma, acc_s, tSrQ, tSrK, thr_a.partition_S(sQ), thr_b.partition_S(sK), copy_a, copy_b, thr_a, thr_b);
  const int diagonal = seqlen_k - seqlen_q;
  // One branch for every score transform, as the mask alone had (a branch is a scheduling barrier in the loop
  // every plain tile runs).
  if (mask || p.softcap_in > 0.f || alibi != 0.f) {
    if (p.softcap_in > 0.f) apply_softcap(acc_s, p.softcap_in);
    if (alibi != 0.f) apply_alibi(acc_s, tScS, alibi, row_offset, col_offset, diagonal);
    if (mask) apply_mask(acc_s, tScS, p, row_offset, col_offset, seqlen_q, seqlen_k);
  }
  Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) s(mi, ni) = exp2f(s(mi, ni) * p.scale_log2 - lse_log2[mi]);
  }

  Tensor acc_dp = partition_fragment_C(mma, BlockS{});
  clear(acc_dp);
  gemm_ss(mma, acc_dp, tSrQ, tSrK, thr_a.partition_S(sdO), thr_b.partition_S(sV), copy_a, copy_b, thr_a, thr_b);
  Tensor dp = make_tensor(acc_dp.data(), rowcol_layout(acc_dp.layout()));
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(dp); ++ni) dp(mi, ni) = s(mi, ni) * (dp(mi, ni) - d_row[mi]);
  }
  // The transforms, in a branch after the plain tile's work rather than between the GEMM and it.
  const bool dropout = p.rng_state != nullptr;
  if (dropout || p.softcap_in > 0.f) {
    // Dropout's dS = P (Z dP / (1-p) - D): from the plain P (dP - D) above, a kept score's is that / (1-p) plus
    // (1/(1-p) - 1) P D, a dropped one's -P D. With softcap too, whose loop reads the undropped P, the kept bits (bit
    // mi * columns + ni) are drawn once and applied to P after it.
    static_assert(decltype(size(acc_s))::value <= 64);
    uint64_t kept_bits = 0;
    const float scale = p.dropout_scale;
    auto dropout_ds = [&](int mi, int ni, bool kept) {
      const float pd = s(mi, ni) * d_row[mi];
      dp(mi, ni) = kept ? dp(mi, ni) * scale + (scale - 1.f) * pd : -pd;
    };
    if (dropout && p.softcap_in <= 0.f) {
      // Dropout alone: P is dropped as the mask is drawn, with no bits kept for later (their packing and unpacking
      // cost more integer work per score than the draw's share, docs/tuning.md#dropout).
      for_each_kept<Traits::kBlockN == 32 ? 0 : 1, /*kInline=*/false>(acc_dp, tScS, draw, row_offset, col_offset,
          [&](int mi, int ni, bool kept) {
            dropout_ds(mi, ni, kept);
            s(mi, ni) = kept ? s(mi, ni) * scale : 0.f;
          });
    } else if (dropout) {
      for_each_kept<Traits::kBlockN == 32 ? 0 : 1, /*kInline=*/false>(acc_dp, tScS, draw, row_offset, col_offset,
          [&](int mi, int ni, bool kept) {
            kept_bits |= uint64_t(kept) << (mi * size<1>(dp) + ni);
            dropout_ds(mi, ni, kept);
          });
    }
    if (p.softcap_in > 0.f) {
      // d(softcap * tanh(x * softcap_in)) / dx = softmax_scale * (1 - tanh^2); softmax_scale is applied with the
      // dQ / dK epilogues. tanh is recovered from P (before dropout) rather than kept from above: t = log2 P /
      // scale_log2 + lse*log2e / scale_log2 (less the ALiBi bias) costs one MUFU op per score and no registers
      // across the dP GEMM. The factor is clamped at 0, which also gives P = 0 (masked, or too small to matter;
      // t = -inf or NaN there) dS = 0 in one FMNMX: this loop's instructions are exposed between the GEMMs.
      const float inv_scale_log2 = 1.f / p.scale_log2;
      auto apply_dtanh = [&](auto with_alibi) {
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const float row_term = lse_log2[mi] * inv_scale_log2;
          const float row_distance =
              with_alibi ? alibi_row_distance(c, mi, row_offset, col_offset, diagonal) : 0.f;
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(dp); ++ni) {
            float t = fmaf(__log2f(s(mi, ni)), inv_scale_log2, row_term);
            if constexpr (decltype(with_alibi)::value) t -= alibi * fabsf(row_distance - alibi_col_step(c, ni));
            dp(mi, ni) *= fmaxf(1.f - t * t, 0.f);
          }
        }
      };
      if (alibi != 0.f) {
        apply_dtanh(std::true_type{});
      } else {
        apply_dtanh(std::false_type{});
      }
    }
    if (dropout && p.softcap_in > 0.f) {  // P becomes what the forward multiplied V by: dropped, the kept rescaled
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(s); ++ni) {
          s(mi, ni) = (kept_bits >> (mi * size<1>(s) + ni)) & 1 ? s(mi, ni) * p.dropout_scale : 0.f;
        }
      }
    }
  }

  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomOut{}, mma);
  auto thr_pds = copy_pds.get_thread_slice(tid);
  if constexpr (Traits::kPdSInV) __syncthreads();  // sP and sdS take V's bytes: every warp's dP GEMM is done with V
  copy(copy_pds, thr_pds.retile_S(convert_type<Element>(acc_s)), thr_pds.partition_D(sP));
  copy(copy_pds, thr_pds.retile_S(convert_type<Element>(acc_dp)), thr_pds.partition_D(sdS));
}

// S, P, dP and dS for a query block, kBlockMSdP rows at a time (traits.h): the row slabs of sQ, sdO,
// sP and sdS are sub-tiles of the block's. `unmasked`: unmasked_rows (mask.h) for kBlockMSdP-row tiles at col_offset.
template <typename Traits, typename SmemQ, typename SmemKV, typename SmemPdS>
__device__ __forceinline__ void bwd_p_ds_block(BwdParams const& p, SmemQ const& sQ, SmemQ const& sdO,
                                               SmemKV const& sK, SmemKV const& sV, SmemPdS& sP, SmemPdS& sdS,
                                               const float* lse, const float* d_sum, float alibi,
                                               DropoutDraw const& draw, UnmaskedRows const& unmasked, int row_offset,
                                               int col_offset, int seqlen_q, int seqlen_k) {
  constexpr int kSlab = Traits::kBlockMSdP;
  using SlabQ = Shape<Int<kSlab>, Int<Traits::kHeadDim>>;
  using SlabS = Shape<Int<kSlab>, Int<Traits::kBlockN>>;
  CUTE_UNROLL
  for (int h = 0; h < Traits::kBlockM / kSlab; ++h) {
    Tensor sP_h = local_tile(sP, SlabS{}, make_coord(h, 0));
    Tensor sdS_h = local_tile(sdS, SlabS{}, make_coord(h, 0));
    bwd_p_ds<Traits>(p, local_tile(sQ, SlabQ{}, make_coord(h, 0)), local_tile(sdO, SlabQ{}, make_coord(h, 0)), sK,
                     sV, sP_h, sdS_h, lse, d_sum, alibi, draw, unmasked.needs_mask(row_offset + h * kSlab),
                     row_offset + h * kSlab, col_offset, seqlen_q, seqlen_k);
  }
}

// acc_dq += dS K for one tile (dS and K both from shared memory; K read transposed).
template <typename Traits, typename Acc, typename SmemPdS, typename SmemKt>
__device__ __forceinline__ void bwd_dq_tile(Acc& acc_dq, SmemPdS const& sdS, SmemKt const& sKt) {
  using Element = typename Traits::Element;
  const int tid = threadIdx.x;
  typename Traits::TiledMmadQ mma;
  auto thr_mma = mma.get_thread_slice(tid);
  auto copy_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma);
  auto copy_b = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma);
  auto thr_a = copy_a.get_thread_slice(tid);
  auto thr_b = copy_b.get_thread_slice(tid);
  Tensor tdQrdS = thr_mma.partition_fragment_A(fragment_shape<Element, Traits::kBlockM, Traits::kBlockN>());
  Tensor tdQrKt = thr_mma.partition_fragment_B(fragment_shape<Element, Traits::kHeadDim, Traits::kBlockN>());
  gemm_ss(mma, acc_dq, tdQrdS, tdQrKt, thr_a.partition_S(sdS), thr_b.partition_S(sKt), copy_a, copy_b, thr_a, thr_b);
}

// Stage a (rows, kHeadDim) accumulator tile through shared memory `sOut` and store it to `gOut`,
// scaled and converted to Element, writing only rows < max_row and columns < head_dim.
template <typename Traits, typename TiledMma, typename Acc, typename SmemOut, typename GmemOut>
__device__ __forceinline__ void store_acc_tile(TiledMma const& mma, Acc& acc, float scale, SmemOut& sOut,
                                               GmemOut& gOut, int max_row, int head_dim) {
  using Element = typename Traits::Element;
  const int tid = threadIdx.x;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) acc(i) *= scale;
  Tensor r = convert_type<Element>(acc);
  auto copy_smem = make_tiled_copy_C(typename Traits::SmemCopyAtomOut{}, mma);
  auto thr_smem = copy_smem.get_thread_slice(tid);
  copy(copy_smem, thr_smem.retile_S(r), thr_smem.partition_D(sOut));
  __syncthreads();
  typename Traits::GmemTiledCopyOut copy_gmem;
  auto thr_gmem = copy_gmem.get_thread_slice(tid);
  Tensor tOgO = thr_gmem.partition_D(gOut);
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  copy(copy_gmem, thr_gmem.partition_S(sOut), tOrO);
  Tensor tOcO = thr_gmem.partition_D(make_identity_tensor(shape(gOut)));
  store_tile(copy_gmem, tOrO, tOgO, tOcO, max_row, head_dim);
}

}  // namespace fa2
