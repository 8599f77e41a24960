// Backward: the launches of a plan (common/plan.h) on the Hopper family: the mma.sync family's preprocess (D and
// dq_accum zeroed) before this family's main kernel, whose dq_accum is laid out as theirs (row-major fp32, lse's rows),
// and their dQ conversion after it where the kernel does not convert dQ itself (persistent tiles do). Included only
// by its generated TUs (sm_90a code, instantiations/axes.json), one (head dim, dtype) each: builds the TMA descriptors
// of this call's q, k, v and dout.                                                         docs/tuning.md#sm90-backward
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include <cuda_runtime.h>

#include "common/launch.h"
#include "common/plan.h"
#include "sm80/bwd_row_kernels.h"
#include "sm90/api.h"
#include "sm90/bwd_kernel.h"
#include "sm90/bwd_traits.h"
#include "sm90/config.h"
#include "sm90/seq_rows.h"

namespace fa2::sm90 {

// One tile of the head dim's (config.h: bwd_tile): full attention's or causal's, which are one at d64 and d256.
template <int kHeadDim, bool kCausal, DType kDType>
void run_bwd_tile(const BwdParams& p, const BwdPlan& plan, cudaStream_t stream) {
  constexpr BwdTileShape kTile = bwd_tile(kHeadDim, kCausal);
  using Traits = BwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.stages, kDType>;
  using Element = typename Traits::Element;
  static_assert(Traits::kSmemSize <= bwd_smem_bytes(kTile), "config.h sizes the tile");
  if (plan.family != Family::kSm90 || plan.head_dim != kHeadDim || p.head_dim != kHeadDim ||
      plan.shape.block_m != Traits::kBlockM ||  // ops.cpp sizes the deterministic semaphores with it
      plan.walk_heads < 1 || p.nheads % p.nheads_k != 0 || (p.nheads / p.nheads_k) % plan.walk_heads != 0 ||
      p.dkv_fp32 != (plan.walk_heads != p.nheads / p.nheads_k) ||  // ops.cpp's slices: fp32 where the host sums
      (p.cu_seqlens_q != nullptr && !Traits::kPacks) ||  // the plan gives packed sequences a tile that reads them
      p.deterministic != (p.dq_semaphore != nullptr) || p.rng_state != nullptr ||
      p.softcap_in > 0.f ||
      p.alibi_slopes != nullptr || p.window_left >= 0 || p.window_right > 0 ||
      int64_t(p.batch) * p.nheads * p.seqlen_q > INT32_MAX || int64_t(p.nheads) * p.total_q > INT32_MAX ||
      int64_t(p.batch) * p.nheads * ceil_div_host(p.seqlen_k, Traits::kBlockN) > INT32_MAX) {
    throw std::logic_error("fa2: a backward plan the Hopper family does not serve (host/plan.cpp)");
  }
  bind_context();  // before the driver encodes the TMA descriptors (autograd's thread may have no context yet)
  BwdKernelParams<Traits> k;
  // q, k, v and dout as TMA sees them (seq_rows.h: tma_rows_view): rows past a sequence's end arrive as zeros.
  const bool varlen = p.cu_seqlens_q != nullptr;
  auto in = [](const void* ptr) { return static_cast<const Element*>(ptr); };
  Tensor mQ = tma_rows_view<kHeadDim>(in(p.q), p.q_stride, p.seqlen_q, p.nheads, p.batch, p.total_q, varlen);
  Tensor mdO = tma_rows_view<kHeadDim>(in(p.dout), p.dout_stride, p.seqlen_q, p.nheads, p.batch, p.total_q, varlen);
  Tensor mK = tma_rows_view<kHeadDim>(in(p.k), p.k_stride, p.seqlen_k, p.nheads_k, p.batch, p.total_k, varlen);
  Tensor mV = tma_rows_view<kHeadDim>(in(p.v), p.v_stride, p.seqlen_k, p.nheads_k, p.batch, p.total_k, varlen);
  using MD = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>;
  using ND = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>;
  k.tma_q = make_tma_copy(SM90_TMA_LOAD{}, mQ, take<0, 2>(typename Traits::SmemLayoutQ{}), MD{}, _1{});
  k.tma_do = make_tma_copy(SM90_TMA_LOAD{}, mdO, take<0, 2>(typename Traits::SmemLayoutdO{}), MD{}, _1{});
  k.tma_k = make_tma_copy(SM90_TMA_LOAD{}, mK, typename Traits::SmemLayoutK{}, ND{}, _1{});
  k.tma_v = make_tma_copy(SM90_TMA_LOAD{}, mV, typename Traits::SmemLayoutV{}, ND{}, _1{});
  k.shape_q = mQ.shape(), k.shape_k = mK.shape();
  // lse and d_sum flat, one rank-1 TMA each (the plan checked that the length fits an int and the bases' alignment):
  // (batch, nheads, seqlen_q), or packed (nheads, total_q).
  const int64_t stats_total = varlen ? int64_t(p.nheads) * p.total_q : int64_t(p.batch) * p.nheads * p.seqlen_q;
  auto flat = [&](const float* ptr) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(int32_t(stats_total)), Stride<_1>{});
  };
  using MStats = typename Traits::StatsBox;
  k.tma_lse = make_tma_copy(SM90_TMA_LOAD{}, flat(p.lse), Layout<MStats>{}, MStats{}, _1{});
  k.tma_d = make_tma_copy(SM90_TMA_LOAD{}, flat(p.d_sum), Layout<MStats>{}, MStats{}, _1{});
  k.stats_total = int32_t(stats_total);
  k.stats_head_rows = varlen ? p.total_q : p.seqlen_q;
  // dq_accum, row-major fp32 with lse's rows, as the mma.sync family's preprocess and convert lay it out: (rows, head
  // dim, heads, batch), or packed (nheads, total_q) rows viewed as q is; the dQ writer adds its slabs into it, and
  // TMA drops the rows past a sequence's end.
  const Strides dq_rows = {int64_t(p.nheads) * p.seqlen_q * kHeadDim, int64_t(kHeadDim),
                           int64_t(varlen ? p.total_q : p.seqlen_q) * kHeadDim};
  Tensor mdQ = tma_rows_view<kHeadDim>(p.dq_accum, dq_rows, p.seqlen_q, p.nheads, p.batch, p.total_q, varlen);
  k.tma_dq =
      make_tma_copy(SM90_TMA_REDUCE_ADD{}, mdQ, typename Traits::SmemLayoutdQSlab{}, typename Traits::dQSlab{}, _1{});
  k.dk = p.dk, k.dv = p.dv, k.dkv_fp32 = p.dkv_fp32;
  // dK and dV by TMA (config.h: bwd_stores_dkv_by_tma) where their buffers allow it: the input dtype (not the float32
  // slices the host sums), a 16-byte aligned base and strides (checks.cpp lets any stride through along a dimension of
  // 1). Viewed as k is (packed: each sequence's rows end at its last key).
  auto tma_ok = [](const void* ptr, const Strides& s) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && s.batch % 8 == 0 && s.row % 8 == 0 && s.head % 8 == 0;
  };
  k.dkv_tma = Traits::kdKVByTma && !p.dkv_fp32 && tma_ok(p.dk, p.dk_stride) && tma_ok(p.dv, p.dv_stride);
  if (k.dkv_tma) {
    auto out = [](void* ptr) { return static_cast<Element*>(ptr); };
    const int slices = p.nheads / plan.walk_heads;
    Tensor mdK = tma_rows_view<kHeadDim>(out(p.dk), p.dk_stride, p.seqlen_k, slices, p.batch, p.total_k, varlen);
    Tensor mdV = tma_rows_view<kHeadDim>(out(p.dv), p.dv_stride, p.seqlen_k, slices, p.batch, p.total_k, varlen);
    k.tma_dk = make_tma_copy(SM90_TMA_STORE{}, mdK, typename Traits::SmemLayoutK{}, ND{}, _1{});
    k.tma_dv = make_tma_copy(SM90_TMA_STORE{}, mdV, typename Traits::SmemLayoutV{}, ND{}, _1{});
  }
  k.dk_row_stride = p.dk_stride.row, k.dk_head_stride = p.dk_stride.head, k.dk_batch_stride = p.dk_stride.batch;
  k.dv_row_stride = p.dv_stride.row, k.dv_head_stride = p.dv_stride.head, k.dv_batch_stride = p.dv_stride.batch;
  k.seqlen_q = p.seqlen_q, k.seqlen_k = p.seqlen_k, k.nheads = p.nheads, k.head_group_kv = p.nheads / p.nheads_k;
  k.cu_seqlens_q = p.cu_seqlens_q, k.cu_seqlens_k = p.cu_seqlens_k, k.total_q = p.total_q, k.total_k = p.total_k;
  k.walk_heads = plan.walk_heads, k.tile_heads = p.nheads / plan.walk_heads;
  k.scale_log2 = p.scale_log2, k.softmax_scale = p.softmax_scale;
  k.causal = p.causal();
  k.head_group = p.head_group;
  k.dq_semaphore = p.dq_semaphore;
  k.dq_accum = p.dq_accum, k.dq = p.dq;
  k.dq_row_stride = p.dq_stride.row, k.dq_head_stride = p.dq_stride.head, k.dq_batch_stride = p.dq_stride.batch;
  k.m_blocks = ceil_div_host(p.seqlen_q, Traits::kBlockM);
  k.batch = p.batch;
  // Rotated walks make a key block wait for higher ones of its head (bwd_kernel.h), which is safe only when a whole
  // head's key blocks fit on the GPU at once (one CTA an SM): else the started ones could fill every SM waiting for
  // one that cannot start (bench/det_rotate.cu). Half the SMs, so that kernels on other streams (NCCL's) holding some
  // cannot bring that about. Longer keys keep key-block order, whose skew they amortise anyway (1.01x at 16k).
  const int n_blocks = ceil_div_host(p.seqlen_k, Traits::kBlockN);
  k.n_blocks = n_blocks;
  // The plain order only (head_group 0, as full attention has): the tickets then start a head's key blocks together.
  // Padded batches only: the turns count the grid's key blocks, and a packed sequence may have fewer.
  k.dq_rotate = p.dq_semaphore != nullptr && !k.causal && p.head_group == 0 && !varlen &&
                2 * n_blocks <= device_sm_count();

  constexpr int smem = Traits::kSmemSize;
  const int limit = block_smem_limit(p);
  if (smem > limit) throw_smem_too_small("backward", p.head_dim, smem, limit);

  const int rows_per_cta = kRowKernelWarps * (32 / row_lanes(p.head_dim));  // preprocess / convert (sm80)
  const dim3 row_grid(ceil_div_host(p.seqlen_q, rows_per_cta), p.nheads, p.batch);
  bwd_preprocess_kernel<Element><<<row_grid, 32 * kRowKernelWarps, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "sm90 bwd preprocess launch");
  if (p.dq_semaphore) {
    const size_t bytes = sizeof(int) * (size_t(p.batch) * p.nheads * k.m_blocks + 1);  // the semaphores, the tickets
    check_cuda(cudaMemsetAsync(p.dq_semaphore, 0, bytes, stream), "sm90 bwd semaphore zeroing");
  }

  constexpr auto kernel = &bwd_kernel<Traits>;
  allow_smem<kernel>(smem, "sm90 bwd smem");
  // Tiles (key block, walk, batch), key blocks fastest: the CTAs of a walk run together and share its heads' Q and dO
  // in L2; causal: heaviest first within groups of walks (the plan's head_group). One persistent CTA per SM draws them
  // from a counter (the preprocess zeroes it), so a tile's start overlaps the previous one's end, where that pays
  // (config.h: bwd_persistent). Deterministic mode keeps a CTA per tile (its turns assume every key block of a head
  // can run at once).
  const int tiles = n_blocks * k.tile_heads * p.batch;
  const bool persistent = Traits::kPersistent && p.dq_semaphore == nullptr && p.tile_counter != nullptr;
  k.tile_counter = persistent ? p.tile_counter : nullptr;
  // Persistent CTAs convert dQ as its query blocks complete (bwd_dq_convert.h), so no kernel runs after them.
  const bool converts = persistent && p.dq_done != nullptr;
  k.dq_done = converts ? p.dq_done : nullptr;
  if (converts) {
    const size_t bytes = sizeof(int) * size_t(k.m_blocks) * p.batch * p.nheads;
    check_cuda(cudaMemsetAsync(p.dq_done, 0, bytes, stream), "sm90 bwd dq_done zeroing");
  }
  const dim3 grid = !Traits::kPersistent ? dim3(n_blocks, k.tile_heads, p.batch)
                    : persistent         ? dim3(std::min(tiles, device_sm_count()))
                                         : dim3(tiles);
  kernel<<<grid, kBwdThreads, smem, stream>>>(k);
  check_cuda(cudaGetLastError(), "sm90 bwd launch");

  if (!converts) {
    bwd_convert_dq_kernel<Element><<<row_grid, 32 * kRowKernelWarps, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "sm90 bwd convert launch");
  }
}

// The plan's tile: one kernel per head dim, two where full attention's tile is not causal's (d128).
template <int kHeadDim, DType kDType>
void run_bwd(const BwdParams& p, const BwdPlan& plan, cudaStream_t stream) {
  constexpr int kFullBlockM = bwd_tile(kHeadDim, false).block_m;
  if constexpr (kFullBlockM != bwd_tile(kHeadDim, true).block_m) {
    if (plan.shape.block_m == kFullBlockM) return run_bwd_tile<kHeadDim, false, kDType>(p, plan, stream);
  }
  run_bwd_tile<kHeadDim, true, kDType>(p, plan, stream);
}

}  // namespace fa2::sm90
