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

// The backward (bwd_kernel.h; docs/tuning.md#sm90-backward), at d64 and d128 (one 64 x 128 tile). One CTA per (key
// block, head, batch) = a producer warpgroup (TMA: K and V once, Q and dO with lse and D per query block through a two-
// stage ring each; a dQ writer warp) and two MMA warpgroups of 64 keys each, which walk the query blocks that see their
// keys: S^T = K Q^T and dP^T = V dO^T by wgmma from shared memory, dV += P^T dO and dK += dS^T Q with P^T and dS^T from
// registers, dQ = dS K with dS through shared memory, staged in shared memory and added into the fp32 dq_accum by the
// writer's TMA reduce-add. 64 x 128 is FA3's causal d128 tile (flash_bwd_launch_template.h); a larger d64 tile, d256's
// and the non-causal 80 x 128 are later steps.
constexpr bool bwd_has_tile(int head_dim) { return head_dim == 64 || head_dim == 128; }

constexpr BwdTileShape bwd_tile(int head_dim) { return {head_dim, 64, 128, 2, false, false}; }

// Shared memory of a tile: K and V, two stages of Q, dO and dS (2-byte elements), each stage's lse and D (floats),
// dQ's fp32 staging, plus the barriers; bwd_launch.h asserts the traits' SharedStorage fits it.
constexpr int bwd_smem_bytes(BwdTileShape t) {
  return (2 * t.block_n + 2 * t.stages * t.block_m) * t.head_dim * 2 + t.stages * t.block_m * t.block_n * 2 +
         2 * t.stages * (t.block_m + 32) * 4 + t.block_m * t.head_dim * 4 + 1024;
}

// What the backward of this family computes so far: padded batches, any lengths, MHA/GQA/MQA (dK and dV per query
// head, as the mma.sync backward writes them), full or causal attention, deterministic or not, at the compiled head
// dims exactly. Varlen, windows, softcap, ALiBi and dropout run on the mma.sync family, by the plan.
constexpr bool bwd_serves(int head_dim, bool varlen, int window_left, int window_right, bool softcap, bool alibi,
                          bool dropout) {
  return bwd_has_tile(head_dim) && !varlen && window_left < 0 && window_right <= 0 && !softcap && !alibi && !dropout;
}

}  // namespace fa2::sm90
