// The Hopper family's table: per head dim the forward's tile and pipeline depth, as constexpr functions of the
// runtime head dim that the host's launch plan (host/plan.cpp) and the launch (fwd_launch.h) both read, and what the
// family serves. A call it does not serve runs on the mma.sync family, by the plan.       docs/tuning.md#sm90-forward
//
// One persistent CTA per SM = a producer warpgroup (one thread draws the tiles and issues the TMA loads of Q once per
// tile and of K and V through a `kStages` ring) and two consumer warpgroups of 64 query rows each (wgmma: S = Q K^T
// from shared memory, O += P V with P from registers), taking turns at the tensor cores.
// 128 x 128 tiles at d64 and d128; at d256 128 x 80, the widest key block whose two K/V stages and Q fit in 227 KB.
#pragma once

#include "common/plan.h"

namespace fa2::sm90 {

constexpr int kWarpgroupThreads = 128, kConsumerWarpgroups = 2;
constexpr int kThreads = (1 + kConsumerWarpgroups) * kWarpgroupThreads;

constexpr bool fwd_has_tile(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

constexpr FwdTileShape fwd_tile(int head_dim) {
  return {64 * kConsumerWarpgroups, head_dim == 256 ? 80 : 128, kThreads / 32, 2};
}

// Whether O leaves through shared memory and a TMA store (traits.h): where its tile fits beside Q, K and V.
constexpr bool fwd_stores_by_tma(int head_dim) { return head_dim <= 128; }

// Shared memory of a tile: Q (and O where it is stored by TMA), and K and V per stage (2-byte elements), plus the
// barriers; fwd_launch.h asserts the traits' SharedStorage fits it.
constexpr int fwd_smem_bytes(FwdTileShape t, int head_dim) {
  return (t.block_m * (fwd_stores_by_tma(head_dim) ? 2 : 1) + 2 * t.stages * t.block_n) * head_dim * 2 + 2048;
}

// What the forward of this family computes: padded batches of q, k and v and packed ones (varlen: cu_seqlens, each
// sequence bottom-right aligned on its own), no KV cache, any lengths, MHA/GQA/MQA, full, causal or windowed
// attention, softcap, ALiBi, sinks and dropout (the mma.sync family's mask, sm90/dropout.h), at the compiled head dims
// exactly. Split-KV is the mma.sync family's, and so are calls of at most 64 query rows (decoding; varlen:
// max_seqlen_q), whose 64-row tile and split-KV fill the GPU where a 128-row tile would not.
constexpr bool fwd_serves(int head_dim, int seqlen_q, bool kvcache, int /*window_left*/, int /*window_right*/,
                          bool /*softcap*/, bool /*alibi*/, bool /*sink*/, bool /*dropout*/) {
  return fwd_has_tile(head_dim) && seqlen_q > 64 && !kvcache;
}

// The backward (bwd_kernel.h; docs/tuning.md#sm90-backward). A CTA per (key block, walk of query heads, batch), or a
// persistent CTA per SM taking such tiles in turn (bwd_persistent): a producer warpgroup (TMA: K and V once a tile, Q
// (two stages) and dO with lse and D per query block; a dQ writer warp) and two MMA warpgroups, which walk the query
// blocks that see their keys, head after head.
// d64 and d128: 64 keys per warpgroup: S^T = K Q^T and dP^T = V dO^T by wgmma from shared memory, dV += P^T dO and
// dK += dS^T Q with P^T and dS^T from registers, dQ = dS K with dS through shared memory, staged in shared memory and
// added into the fp32 dq_accum by the writer's TMA reduce-add. Two dO stages. d128: 80 queries x 128 keys for full
// attention and 64 x 128 causal (FA3's d128 tiles, flash_bwd_launch_template.h): 80 queries are a quarter more work
// for the same handoffs per block (pipeline waits, the dS barrier, the dQ slab); causal keeps 64, persistent and
// without a diagonal block split across query blocks (80 rows measured 0.955-1.018 of it). 80 is no wgmma M, so that
// tile computes dQ^T = K^T dS^T (bwd_traits.h).
// 128 x 128 at d64 (FA3's d64 tile: d64's GEMMs are short, so twice the queries per block halve the handoffs per
// FLOP).
// d256 (bwd_mma_wide.h): 64 x 64 (cuDNN's d256 tile). dK and dV over all 256 dims for 64 keys would be 256 fp32
// registers a thread, so the warpgroups split the head dim instead (dK^T, dV^T: 128 dims x 64 keys each, 128
// registers), which puts P and dS in shared memory; S and dP are not transposed (32 keys per warpgroup), dQ is computed
// per 128-column half and staged for the dQ writer as at d128. One dO stage: two would not fit beside the staging.
constexpr bool bwd_has_tile(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

// Packed sequences (varlen) at d128 take the causal tile (bwd_kernel.h reads each sequence's lengths per tile, and
// the 80-row tile's 240 registers spilled for one more).
constexpr BwdTileShape bwd_tile(int head_dim, bool causal, bool varlen = false) {
  const int block_m = head_dim == 64 ? 128 : head_dim == 128 && !causal && !varlen ? 80 : 64;
  return {head_dim, block_m, head_dim == 256 ? 64 : 128, 2, false, false};
}
// Whether a tile runs packed sequences (above): all but d128's 80-row tile, which reads the uniform lengths.
constexpr bool bwd_tile_packs(BwdTileShape t) { return t.block_m != 80; }

// dO's stages: as many as Q's, but one at d256 (bwd_mma_wide.h releases it mid-block).
constexpr int bwd_do_stages(BwdTileShape t) { return t.head_dim == 256 ? 1 : t.stages; }

// Persistent CTAs, one per SM drawing tiles from a counter (sm90/bwd_kernel.h), where they measured faster: d64 and
// d128's causal 64-row tile. d128's 80-row tile (24 / 240 registers) ran slower with the tile loop compiled in, and
// d256's MMA warpgroups (bwd_mma_wide.h) start their rings afresh: a CTA per tile there.  docs/tuning.md#sm90-backward
constexpr bool bwd_persistent(BwdTileShape t) { return t.head_dim == 64 || (t.head_dim == 128 && t.block_m == 64); }

// dK and dV leave through shared memory (K's and V's, free once the tile's last GEMM retired; a persistent CTA loads
// the next tile's there once the store has read them) and a TMA store. d256's warpgroups hold dK^T and dV^T
// (bwd_mma_wide.h), and store them from registers.
constexpr bool bwd_stores_dkv_by_tma(BwdTileShape t) { return t.head_dim != 256; }

// The MMA warpgroups' wgmma descriptors of shared memory taken for the warpgroup's first thread, an index ptxas knows
// warp-uniform, so that they stay in uniform registers (no R2UR before each wgmma): only the 80-row tile measured
// faster so.
constexpr bool bwd_uniform_descriptors(BwdTileShape t) { return t.block_m == 80; }

// Shared memory of a tile: K and V, the Q and dO stages (2-byte elements), their lse and D boxes (floats); d64/d128:
// dS per Q stage; d256: one P and one dS; dQ's fp32 staging (d256: a 128-column half); plus the barriers.
// bwd_launch.h asserts the traits' SharedStorage fits it.
constexpr int bwd_smem_bytes(BwdTileShape t) {
  const bool wide = t.head_dim == 256;
  const int do_stages = bwd_do_stages(t);
  return (2 * t.block_n + (t.stages + do_stages) * t.block_m) * t.head_dim * 2 +
         (wide ? 2 : t.stages) * t.block_m * t.block_n * 2 + (t.stages + do_stages) * (t.block_m + 32) * 4 +
         t.block_m * (wide ? 128 : t.head_dim) * 4 + 1024;
}

// What the backward of this family computes so far: padded batches and packed ones (varlen: each sequence
// bottom-right aligned on its own), any lengths, MHA/GQA/MQA (a tile walks the query heads of a K/V group,
// host/plan.cpp: walk_heads), full or causal attention, deterministic or not, at the compiled head dims exactly.
// Windows, softcap, ALiBi and dropout run on the mma.sync family, by the plan.
constexpr bool bwd_serves(int head_dim, int window_left, int window_right, bool softcap, bool alibi, bool dropout) {
  return bwd_has_tile(head_dim) && window_left < 0 && window_right <= 0 && !softcap && !alibi && !dropout;
}

}  // namespace fa2::sm90
