// FlashAttention-2 backward (reference.py: flash_bwd_tiled) in three kernels:
//   bwd_preprocess_kernel: D = rowsum(dO * O), and zero the fp32 dQ accumulator
//   bwd_kernel:            per K/V block, walk the query blocks: recompute P from lse,
//                          dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dK += dS^T Q, dQ += dS K (atomics)
//   bwd_convert_dq_kernel: dQ = softmax_scale * dQ_accum, in the input dtype
// With deterministic=true, bwd_kernel skips dQ and bwd_dq_kernel computes it instead: one CTA per query
// block walks the key blocks in order, recomputing P and dS, so no two CTAs add into the same dQ row.
// Names follow CuTe: g* global, s* shared, r* registers; tXsY is tensor Y partitioned for operation X
// (tS: S and dP, tdV / tdK: the dV and dK GEMMs, tdQ: the dQ GEMM).
#pragma once

#include <cute/tensor.hpp>

#include "fa2/mask.h"
#include "fa2/params.h"
#include "fa2/schedule.h"
#include "fa2/seqlen.h"
#include "fa2/utils.h"

namespace fa2 {
using namespace cute;

// The two row-wise kernels (preprocess, convert) give each row of Q the fewest lanes that cover it in
// 16-byte chunks, a power of two (64-dim rows: 8 lanes, 4 rows per warp), so no lane idles on a short row.
// One warp per row left 3/4 of the lanes idle at head_dim 64 (bench/NOTES.md v8).
__host__ __device__ constexpr int row_lanes(int head_dim) {
  int lanes = 1;
  while (lanes < 32 && lanes * 8 < head_dim) lanes *= 2;
  return lanes;
}
constexpr int kRowKernelWarps = 4;

// D = rowsum(dO * O) in fp32, and the fp32 dQ accumulator zeroed (atomics add into it).
template <typename Element>
__global__ void bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
  const int lanes = row_lanes(p.head_dim), lane = threadIdx.x % 32, sub = lane % lanes;
  const int row = (blockIdx.x * kRowKernelWarps + threadIdx.x / 32) * (32 / lanes) + lane / lanes;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq(p, batch, head);
  const bool valid = row < seq.seqlen_q;
  float dot = 0.f;
  if (valid) {
    const Element* dout = &seq.q_tensor<8, const Element>(p.dout, p.dout_stride, batch, head)(row, 0);
    const Element* out = &seq.q_tensor<8, const Element>(p.o, p.o_stride, batch, head)(row, 0);
    for (int c = sub * 8; c < p.head_dim; c += lanes * 8) {
      const uint4 a = *reinterpret_cast<const uint4*>(dout + c);
      const uint4 b = *reinterpret_cast<const uint4*>(out + c);
      const Element* ea = reinterpret_cast<const Element*>(&a);
      const Element* eb = reinterpret_cast<const Element*>(&b);
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) dot += float(ea[i]) * float(eb[i]);
    }
  }
  for (int offset = lanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffff, dot, offset);
  if (!valid) return;
  const int64_t bh_row = seq.stats_row + row;
  if (sub == 0) p.d_sum[bh_row] = dot;
  if (p.deterministic) return;  // dQ comes from bwd_dq_kernel; the accumulator is unused
  float* dq_accum = p.dq_accum + bh_row * p.head_dim;
  for (int c = sub * 4; c < p.head_dim; c += lanes * 4) *reinterpret_cast<float4*>(dq_accum + c) = float4{0, 0, 0, 0};
}

// dQ = softmax_scale * dQ_accum in the input dtype: 8 floats in, one 16-byte store out per lane and step.
template <typename Element>
__global__ void bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
  const int lanes = row_lanes(p.head_dim), lane = threadIdx.x % 32, sub = lane % lanes;
  const int row = (blockIdx.x * kRowKernelWarps + threadIdx.x / 32) * (32 / lanes) + lane / lanes;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq(p, batch, head);
  if (row >= seq.seqlen_q) return;
  const float* acc = p.dq_accum + (seq.stats_row + row) * p.head_dim;
  Element* dq = &seq.q_tensor<8, Element>(p.dq, p.dq_stride, batch, head)(row, 0);
  for (int c = sub * 8; c < p.head_dim; c += lanes * 8) {
    const float4 a = *reinterpret_cast<const float4*>(acc + c);
    const float4 b = *reinterpret_cast<const float4*>(acc + c + 4);
    const float s = p.softmax_scale;
    const Element e[8] = {Element(a.x * s), Element(a.y * s), Element(a.z * s), Element(a.w * s),
                          Element(b.x * s), Element(b.y * s), Element(b.z * s), Element(b.w * s)};
    *reinterpret_cast<uint4*>(dq + c) = *reinterpret_cast<const uint4*>(e);
  }
}

// Where each operand lives in the dynamic shared memory of both backward kernels.
template <typename Traits>
struct BwdSmem {
  using Element = typename Traits::Element;
  Element* base;
  __device__ explicit BwdSmem(char* smem) : base(reinterpret_cast<Element*>(smem)) {}
  __device__ Element* q(int stage) const { return base + stage * Traits::kQdOElems; }
  __device__ Element* dout(int stage) const { return base + (Traits::kStages + stage) * Traits::kQdOElems; }
  __device__ Element* k() const { return base + 2 * Traits::kStages * Traits::kQdOElems; }
  __device__ Element* v() const { return k() + Traits::kKVElems; }
  __device__ Element* p() const { return Traits::kPdSInV ? v() : v() + Traits::kKVElems; }
  __device__ Element* ds() const { return p() + Traits::kPdSElems; }
  // Where dQ is re-tiled for the atomics: the warps' own slabs past kSmemSize on sm90, else sP and sdS.
  __device__ float* dq_stage() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (Traits::kDqWarpSlabs) return reinterpret_cast<float*>(ds() + Traits::kPdSElems);
#endif
    return reinterpret_cast<float*>(p());
  }
  template <typename Layout>
  __device__ static auto tensor(Element* ptr, Layout layout) { return make_tensor(make_smem_ptr(ptr), layout); }
};

// Register fragments are shaped by a plain row-major (rows, cols) layout; no memory behind it.
template <typename Element, int kRows, int kCols>
__device__ __forceinline__ auto fragment_shape() {
  return make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                     make_layout(Shape<Int<kRows>, Int<kCols>>{}, GenRowMajor{}));
}

// One (query block, key block) tile, shared by both kernels: S = Q K^T, P = exp2(S*scale_log2 - lse*log2e)
// (the forward's probabilities, recomputed), dP = dO V^T, dS = P * (dP - D); P and dS are written to
// shared memory. The caller synchronises before reading sP / sdS.
template <typename Traits, typename SmemQ, typename SmemKV, typename SmemPdS>
__device__ __forceinline__ void bwd_p_ds(BwdParams const& p, SmemQ const& sQ, SmemQ const& sdO, SmemKV const& sK,
                                         SmemKV const& sV, SmemPdS& sP, SmemPdS& sdS, const float* lse,
                                         const float* d_sum, int row_offset, int col_offset, int seqlen_q,
                                         int seqlen_k) {
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
  if (col_offset + Traits::kBlockN > seqlen_k || (p.causal && col_offset + Traits::kBlockN - 1 > row_offset + diagonal)) {
    apply_mask(acc_s, tScS, row_offset, col_offset, seqlen_q, seqlen_k, p.causal);
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

  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomOut{}, mma);
  auto thr_pds = copy_pds.get_thread_slice(tid);
  if constexpr (Traits::kPdSInV) __syncthreads();  // sP and sdS take V's bytes: every warp's dP GEMM is done with V
  copy(copy_pds, thr_pds.retile_S(convert_type<Element>(acc_s)), thr_pds.partition_D(sP));
  copy(copy_pds, thr_pds.retile_S(convert_type<Element>(acc_dp)), thr_pds.partition_D(sdS));
}

// S, P, dP and dS for a query block, kBlockMSdP rows at a time (traits.h): the row slabs of sQ, sdO,
// sP and sdS are sub-tiles of the block's.
template <typename Traits, typename SmemQ, typename SmemKV, typename SmemPdS>
__device__ __forceinline__ void bwd_p_ds_block(BwdParams const& p, SmemQ const& sQ, SmemQ const& sdO,
                                               SmemKV const& sK, SmemKV const& sV, SmemPdS& sP, SmemPdS& sdS,
                                               const float* lse, const float* d_sum, int row_offset,
                                               int col_offset, int seqlen_q, int seqlen_k) {
  constexpr int kSlab = Traits::kBlockMSdP;
  using SlabQ = Shape<Int<kSlab>, Int<Traits::kHeadDim>>;
  using SlabS = Shape<Int<kSlab>, Int<Traits::kBlockN>>;
  CUTE_UNROLL
  for (int h = 0; h < Traits::kBlockM / kSlab; ++h) {
    Tensor sP_h = local_tile(sP, SlabS{}, make_coord(h, 0));
    Tensor sdS_h = local_tile(sdS, SlabS{}, make_coord(h, 0));
    bwd_p_ds<Traits>(p, local_tile(sQ, SlabQ{}, make_coord(h, 0)), local_tile(sdO, SlabQ{}, make_coord(h, 0)), sK,
                     sV, sP_h, sdS_h, lse, d_sum, row_offset + h * kSlab, col_offset, seqlen_q, seqlen_k);
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

// How add_dq_to_accum brings one key block's share of dQ (fp32, MMA layout) to the global accumulator.
// Scalar atomics on the MMA layout touch half-used sectors and made the backward L2-bound. Three better
// ways: on sm90, where each warp owns a 32 x 32 dQ slab, the warp re-tiles its slab alone into float4 rows
// (no CTA barrier); else re-tile dQ CTA-wide through the bytes of sP and sdS (free once the GEMMs are done)
// so each thread adds 4 consecutive floats (float4 atomics on sm90, coalesced scalars on sm80); or, on
// sm90, add the MMA's column pairs directly as float2 atomics (4 threads fill a 32-byte sector).
// Measured on the H100 (bench/NOTES.md v4, v8): where the warps own 32 x 32 slabs (d64, d128), each warp
// re-tiles its own slab, which beat both alternatives by 4-8%; elsewhere CTA-wide staging wins at
// head_dim <= 64 and direct float2 atomics (which already fill whole 32-byte sectors) above, where the
// staging's two barriers and smem traffic cost more.
enum class DqPath { kWarpSlabs, kStagedInPdS, kDirect };
template <typename Traits>
__device__ constexpr DqPath dq_path() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kVectorAtomics = true;  // red.global.add.v2/v4.f32
  if (Traits::kDqWarpSlabs) return DqPath::kWarpSlabs;
#else
  constexpr bool kVectorAtomics = false;
#endif
  constexpr bool kFitsInPdS = 2 * Traits::kPdSElems * sizeof(typename Traits::Element) >=
                              Traits::kBlockM * Traits::kHeadDim * sizeof(float);
  return (!kVectorAtomics || Traits::kHeadDim <= 64) && kFitsInPdS ? DqPath::kStagedInPdS : DqPath::kDirect;
}

// Add one key block's share of dQ into the global accumulator with atomics, the dq_path() way.
// kCheckBounds = false only for whole query blocks with head_dim == kHeadDim, where every row and column
// is in range.
template <typename Traits, bool kCheckBounds, typename Acc, typename Coord>
__device__ __forceinline__ void add_dq_to_accum(Acc const& acc_dq, Coord const& coord, float* smem_stage,
                                                float* dq_accum, int row_offset, int seqlen_q,
                                                BwdParams const& p) {
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  constexpr DqPath kPath = dq_path<Traits>();
  static_assert(kHeadDim % 32 == 0);
  const int rows = seqlen_q - row_offset;
  // Row stride of the accumulator, a constant on whole blocks: there every atomic's address is one base
  // register plus an immediate, instead of a 64-bit multiply-add per atomic.
  const int ld = kCheckBounds ? p.head_dim : kHeadDim;
  float* dq_rows = dq_accum + int64_t(row_offset) * ld;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kPath == DqPath::kWarpSlabs) {
    // Each warp re-tiles its own 32 x 32 slab (traits.h) in its own 4 KB past the block's shared memory,
    // so only the warp synchronises: no CTA barrier before or after. Rows are 128 bytes with the 32-byte
    // blocks XOR-swizzled by row % 4: the fragment's float2 writes (8 rows x 32 bytes) take 2 wavefronts,
    // the float4 reads 4 per 512 bytes, and each float4 atomic instruction covers 4 rows x 128 contiguous
    // bytes, as the CTA-wide re-tiling does.
    constexpr int kSlab = 32;
    static_assert(kBlockM * kHeadDim == 8 * kSlab * kSlab);
    const int lane = threadIdx.x % 32;
    float* stage = smem_stage + (threadIdx.x / 32) * (kSlab * kSlab);
    const int row0 = get<0>(coord(0)) / kSlab * kSlab, col0 = get<1>(coord(0)) / kSlab * kSlab;
    auto stage_index = [](int r, int c) { return r * kSlab + ((((c >> 3) ^ r) & 3) << 3) + (c & 7); };
    __syncwarp();  // this warp is done reading its previous slab
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {  // (i, i+1) are columns (c, c+1) of one row
      const int r = get<0>(coord(i)) - row0, c = get<1>(coord(i)) - col0;
      *reinterpret_cast<float2*>(stage + stage_index(r, c)) = make_float2(acc_dq(i), acc_dq(i + 1));
    }
    __syncwarp();
    const int r_lane = lane / (kSlab / 4), c = (lane % (kSlab / 4)) * 4;
    float* thr_dst = dq_rows + (row0 + r_lane) * ld + col0 + c;
    CUTE_UNROLL
    for (int it = 0; it < kSlab * kSlab / 4 / 32; ++it) {
      const int r = r_lane + it * (32 * 4 / kSlab);
      if (!kCheckBounds || (row0 + r < rows && col0 + c < p.head_dim)) {
        const float4 v = *reinterpret_cast<const float4*>(stage + stage_index(r, c));
        atomicAdd(reinterpret_cast<float4*>(thr_dst + it * (32 * 4 / kSlab) * ld), v);
      }
    }
  } else
#endif
  if constexpr (kPath == DqPath::kStagedInPdS) {
    // Stage layout: row-major (kBlockM, kHeadDim) floats, XOR-swizzled by row % 8 so that the column-pair
    // writes of one MMA fragment (8 rows x 8 columns, 256 bytes) take the minimum 2 wavefronts. The swizzle
    // unit is the 32-byte block those 8 columns fill; 16-byte units left 2-way conflicts (ncu, head dim 64:
    // 33.5M of 135M shared-store wavefronts, 1.7K after). Head dims not a multiple of 64 keep 16-byte
    // units, so the XOR stays inside the row.
    auto stage_index = [](int r, int c) {
      if constexpr (kHeadDim % 64 == 0) {
        return r * kHeadDim + (((c >> 3) ^ (r & 7)) << 3) + (c & 7);
      } else {
        return r * kHeadDim + (((c >> 2) ^ (r & 7)) << 2) + (c & 3);
      }
    };
    __syncthreads();  // every warp is done reading sP and sdS
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {  // (i, i+1) are columns (c, c+1) of one row
      const int r = get<0>(coord(i)), c = get<1>(coord(i));
      *reinterpret_cast<float2*>(smem_stage + stage_index(r, c)) = make_float2(acc_dq(i), acc_dq(i + 1));
    }
    __syncthreads();
    // Thread t adds float4 chunks t, t + kNThreads, ... of the row-major tile: consecutive threads take
    // consecutive chunks, so an atomic instruction covers whole rows wherever the rows allow.
    constexpr int kChunksPerRow = kHeadDim / 4, kChunks = kBlockM * kChunksPerRow;
    CUTE_UNROLL
    for (int it = 0; it < ceil_div(kChunks, Traits::kNThreads); ++it) {
      const int chunk = int(threadIdx.x) + it * Traits::kNThreads;
      const int r = chunk / kChunksPerRow, c = chunk % kChunksPerRow * 4;
      if ((kChunks % Traits::kNThreads == 0 || chunk < kChunks) && (!kCheckBounds || (r < rows && c < p.head_dim))) {
        const float4 v = *reinterpret_cast<const float4*>(smem_stage + stage_index(r, c));
        float* dst = dq_rows + r * ld + c;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
        atomicAdd(dst + 0, v.x), atomicAdd(dst + 1, v.y), atomicAdd(dst + 2, v.z), atomicAdd(dst + 3, v.w);
#endif
      }
    }
    // The next iteration's first barrier orders these reads before sP / sdS are rewritten.
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      const int r = get<0>(coord(i)), c = get<1>(coord(i));
      if (!kCheckBounds || (r < rows && c < p.head_dim)) {
        // dq_rows + r * ld + c here was 0-1.5% slower at head_dim 128 (v8), and 1-3% at d96, 12-16% at d256
        // with 400+ B of spills (every element's address stays live); scalar atomics on top: 16-40% (v10).
        float* dst = dq_accum + int64_t(row_offset + r) * p.head_dim + c;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float2*>(dst), make_float2(acc_dq(i), acc_dq(i + 1)));
#else
        atomicAdd(dst, acc_dq(i)), atomicAdd(dst + 1, acc_dq(i + 1));
#endif
      }
    }
  }
}

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
  // Query blocks that see at least one key of this block (causal: rows i >= col_offset - diagonal).
  const int m_block_begin = p.causal ? max(0, col_offset - (seq.seqlen_k - seq.seqlen_q)) / kBlockM : 0;
  const int m_block_end = ceil_div(seq.seqlen_q, kBlockM);

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
    // Whole blocks (all but the last, when head_dim is a compiled size) skip the per-chunk row/column tests:
    // with the unchecked dQ atomics below, +1.5-2.6% on the d128 backward (bench/NOTES.md v7).
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

    bwd_p_ds_block<Traits>(p, sQ, sdO, sK, sV, sP, sdS, lse, d_sum, row_offset, col_offset, seq.seqlen_q,
                           seq.seqlen_k);
    __syncthreads();  // sP and sdS complete: every warp reads all of them below

    // This key block's share of dQ, added into the fp32 accumulator (softmax_scale applied later).
    auto dq_step = [&] {
      if (p.deterministic) return;
      Tensor acc_dq = partition_fragment_C(mma_dq, BlockQ{});
      clear(acc_dq);
      bwd_dq_tile<Traits>(acc_dq, sdS, sKt);
      if (row_offset + kBlockM <= seq.seqlen_q && p.head_dim == kHeadDim) {  // whole block: no bounds tests
        add_dq_to_accum<Traits, false>(acc_dq, tdQcdQ, smem.dq_stage(), dq_accum, row_offset,
                                       seq.seqlen_q, p);
      } else {
        add_dq_to_accum<Traits, true>(acc_dq, tdQcdQ, smem.dq_stage(), dq_accum, row_offset,
                                      seq.seqlen_q, p);
      }
    };
    // With direct atomics, dQ goes between dV and dK: the atomics drain while the dK MMAs run, not just before
    // the next block's barrier (+3% at d96, neutral at d256 on the H100; bench/NOTES.md v10). The warp slabs
    // (d64, d128) measured neutral either way and keep dQ last; the CTA-wide staging must (dK reads sdS).
    constexpr bool kDqBeforeDk = dq_path<Traits>() == DqPath::kDirect;
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
  const int n_block_end = key_block_end<kBlockM, kBlockN>(m_block, seq.seqlen_q, seq.seqlen_k, p.causal);

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
  for (int n_block = 0; n_block < n_block_end; ++n_block) {
    const int col_offset = n_block * kBlockN;
    __syncthreads();  // every warp is done reading the previous sK / sV / sdS
    copy_tile<true>(gmem_copy, tKgK(_, _, _, n_block), tKsK, tKcK, seq.seqlen_k - col_offset, p.head_dim);
    copy_tile<true>(gmem_copy, tKgV(_, _, _, n_block), tKsV, tKcK, seq.seqlen_k - col_offset, p.head_dim);
    cp_async_fence();
    cp_async_wait<0>();
    __syncthreads();
    bwd_p_ds_block<Traits>(p, sQ, sdO, sK, sV, sP, sdS, p.lse + seq.stats_row, p.d_sum + seq.stats_row,
                           row_offset, col_offset, seq.seqlen_q, seq.seqlen_k);
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
