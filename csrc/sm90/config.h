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

}  // namespace fa2::sm90
