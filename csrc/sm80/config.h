// The mma.sync family's table, in one place: per head dim the tiles, warps and pipeline stages, the alternative tiles
// a launch plan picks (host/plan.cpp) from the sequence lengths and from the shared memory a block may use, and the
// policies for dQ accumulation, the backward's row kernels and the order of causal grids. The tiles are constexpr
// functions of the runtime head dim, read by the host's plan and by the launches (fwd_launch.h, bwd_launch.h), which
// turn them into Traits (traits.h); kernels see them only through Traits. Each choice says why; the measurements
// behind it are in docs/tuning.md under the tag given.
//
// Shared memory per block, which decides what fits: A100 163 KB, H100 227 KB; sm86, sm89 and sm120 (RTX 30xx,
// 40xx, 50xx; A10, L4, L40) 99 KB. Every head dim has a configuration that fits 99 KB, forward and backward.
#pragma once

#include "common/params.h"
#include "common/plan.h"

namespace fa2 {

// ------------------------------------------------------------------------------------------------ forward
// (kBlockM, kBlockN, warps, K/V stages)                                     docs/tuning.md#forward-tiles
// Each thread holds kBlockM/(16*warps)*2 rows of acc_o (head_dim/4 floats each) and of S (kBlockN/4 floats each);
// past 255 registers the kernel spills, so wide heads get narrower K/V tiles or more warps.
// Stages (docs/tuning.md#forward-stages) = K/V buffers each: 1 is FA2's schedule (two barriers per key block, each
// refill behind one); 2 gives one barrier per block with block n-1's K and V loading during all of block n's work,
// which pays where registers allow it (d64, d96) and loses to spills where they do not (d128, d256). Other head
// dims are unmeasured and keep 1.
constexpr FwdTileShape fwd_main_tile(int head_dim) {
  switch (head_dim) {
    case 32: return {128, 64, 4, 1};
    case 64: return {128, 64, 4, 2};
    case 96: return {128, 64, 4, 2};
    case 128: return {128, 64, 4, 1};
    case 160: return {128, 32, 4, 1};
    case 192: return {128, 64, 8, 1};
    case 224: return {128, 64, 8, 1};
    case 256: return {128, 64, 8, 1};
    default: return {0, 0, 0, 0};  // not a compiled head dim
  }
}
// With two stages, unroll the key-block loop by two so each half reads a fixed buffer (immediate ldmatrix
// offsets instead of a per-block select). It costs registers: d64 has them to spare, d96 spills with it.
//                                                                           docs/tuning.md#forward-unroll
template <int kHeadDim> constexpr bool kFwdUnrollStages = kHeadDim == 64;

// The narrow forward tile, FA2's 64 x 64 on 4 warps (two CTAs per SM), where the main 8-warp tile does not pay or
// does not fit:                                                             docs/tuning.md#forward-narrow-tile
// - short sequences at d256 (max(seqlen_q, seqlen_k) up to fwd_narrow_max_seqlen), where the 8-warp tile's one CTA per
//   SM leaves its Q load, barriers and epilogue exposed; past the thresholds the wide tile is at least as fast;
// - any sequence where the main tile needs more shared memory than a block may use: d224 and d256 on 99 KB GPUs (the
//   other head dims' main tiles fit);
// - decodes (at most 64 query rows after GQA packing, no dropout) and paged KV caches at d160-d256, the decode tile's
//   role at the wide head dims.
// Its kLogits instance runs every call but those with dropout, which only d224 and d256 bring it (the first two
// cases), on their kAll instance: fwd_narrow_runs_all.
constexpr bool fwd_has_narrow_tile(int head_dim) { return head_dim == 160 || head_dim == 192 || head_dim >= 224; }
constexpr bool fwd_narrow_runs_all(int head_dim) { return head_dim == 224 || head_dim == 256; }
constexpr FwdTileShape kFwdNarrowTile = {64, 64, 4, 1};
constexpr int fwd_narrow_max_seqlen(int head_dim, bool causal) { return head_dim != 256 ? 0 : causal ? 2048 : 1024; }

// The decode tile, 64 x 64 on 4 warps (16 rows each), for forwards of at most 64 query rows after GQA packing, as
// decoding's, where the main tile would compute 128 rows for the few that exist. Two K/V stages: a decode streams
// the cache, and with one stage the 16-row warps wait on each load (slower than the main tile at d64). It runs the
// kLogits instance (split-KV and every transform but dropout; a call with dropout keeps the main tile). d64 and d128,
// the head dims measured; the others keep the main tile.                    docs/tuning.md#decode-tile
constexpr bool fwd_has_decode_tile(int head_dim) { return head_dim == 64 || head_dim == 128; }
constexpr FwdTileShape kFwdDecodeTile = {64, 64, 4, 2};

// A paged KV cache (params.h: KvCache) is read by the 64-row tiles alone, the decode and narrow ones: their kLogits
// instances carry the page lookups (every paged call runs one), and the main tile's kLogits loop, which softcap, ALiBi
// and windows run, is kept free of them (any runtime generality in that loop has cost it time:
// docs/tuning.md#paged-kv). Page sizes are multiples of kPageRows, so that a key block lies in one page (fwd_launch.h
// asserts every kBlockN divides it).
constexpr int kPagedTileRows = 64, kPageRows = 64;
constexpr bool fwd_reads_pages(int head_dim) { return fwd_has_decode_tile(head_dim) || fwd_has_narrow_tile(head_dim); }

constexpr bool fwd_tiles_are_consistent() {
  for (int d = 8; d <= 256; d += 8) {
    if (fwd_has_narrow_tile(d) && fwd_has_decode_tile(d)) return false;  // at most one alternative tile
    if (fwd_reads_pages(d) && fwd_main_tile(d).block_m == kPagedTileRows) return false;  // the main tile reads no pages
  }
  return kFwdNarrowTile.block_m == kPagedTileRows && kFwdDecodeTile.block_m == kPagedTileRows;
}
static_assert(fwd_tiles_are_consistent(), "the 64-row tiles read pages, the main one does not; one alternative a dim");

// A forward tile's CTAs per SM: 4 warps at <= 255 registers leave room for two, 8 warps for one.
constexpr int fwd_ctas_per_sm(int warps) { return warps == 4 ? 2 : 1; }

// A forward tile's shared memory: Q, and K and V per stage, in 2-byte elements (fwd_launch.h asserts it is the
// FwdTraits' of each tile).
constexpr int fwd_smem_bytes(FwdTileShape t, int head_dim) {
  return (t.block_m + 2 * t.stages * t.block_n) * head_dim * 2;
}

// Which tile a forward of a compiled head dim runs: the one rule, which the host's launch plan (host/plan.cpp) applies
// once and the launch (fwd_launch.h) executes. seqlen_q is the launch's (after GQA packing; a varlen batch's longest).
// The decode tile has the kLogits instance only, so a call with dropout keeps the main tile; so does the narrow tile
// but at d224 and d256 (above). Each tile runs only where it fits the shared memory a block may use; both 64-row tiles
// fit 99 KB at every head dim that has them. A paged call never has dropout (fa2.attention_with_kvcache).
constexpr FwdTile fwd_tile_for(int head_dim, int seqlen_q, int seqlen_k, bool causal, bool dropout, int smem_limit,
                               bool paged) {
  if (paged) return fwd_has_decode_tile(head_dim) ? FwdTile::kDecode : FwdTile::kNarrow;
  const int seqlen = seqlen_q > seqlen_k ? seqlen_q : seqlen_k;
  if (fwd_narrow_runs_all(head_dim) && (seqlen <= fwd_narrow_max_seqlen(head_dim, causal) ||
                                        fwd_smem_bytes(fwd_main_tile(head_dim), head_dim) > smem_limit)) {
    return FwdTile::kNarrow;
  }
  if (fwd_has_decode_tile(head_dim) && !dropout && seqlen_q <= kFwdDecodeTile.block_m &&
      fwd_smem_bytes(kFwdDecodeTile, head_dim) <= smem_limit) {
    return FwdTile::kDecode;
  }
  if (fwd_has_narrow_tile(head_dim) && !dropout && seqlen_q <= kFwdNarrowTile.block_m) return FwdTile::kNarrow;
  return FwdTile::kMain;
}
constexpr FwdTileShape fwd_tile_shape(FwdTile tile, int head_dim) {
  return tile == FwdTile::kNarrow   ? kFwdNarrowTile
         : tile == FwdTile::kDecode ? kFwdDecodeTile
                                    : fwd_main_tile(head_dim);
}

// Split-KV (fwd_combine.h), for forwards whose CTAs cannot fill the GPU, as decoding's (a query row or a few per
// sequence against a long KV cache): each query block's key blocks are divided among `splits` CTAs and a combine
// kernel merges their partial results. Only the kLogits instances (of every tile) split (fwd_kernel.h): calls with
// dropout run whole (a paged decode at d160-d256 ran 8-9x the unpaged one's time at 1 x 16k while the narrow tile's
// one instance was kAll: docs/tuning.md#paged-kv). The count minimises the modelled time, waves x (key blocks per
// split + kSplitFixedBlocks, a CTA's Q load and epilogue in key blocks' worth), the fewest splits on a tie; each
// split keeps at least kMinSplitKeyBlocks, and the grid's batch x splits stays within CUDA's 65535.
// ctas: the forward's CTAs without splits; slots: CTAs resident at once.
//                                                                           docs/tuning.md#split-kv
constexpr int kMinSplitKeyBlocks = 4, kSplitFixedBlocks = 2;  // kMaxSplits: params.h
constexpr int fwd_num_splits(long long ctas, int batch, int slots, int key_blocks) {
  if (ctas <= 0 || slots <= 0 || ctas >= slots || key_blocks < 2 * kMinSplitKeyBlocks) return 1;
  int best = 1;
  long long best_time = -1;
  for (int s = 1; s <= kMaxSplits && s * kMinSplitKeyBlocks <= key_blocks && 1ll * batch * s <= 65535; ++s) {
    const long long waves = (ctas * s + slots - 1) / slots;
    const long long time = waves * ((key_blocks + s - 1) / s + kSplitFixedBlocks);
    if (best_time < 0 || time < best_time) best = s, best_time = time;
  }
  return best;
}

// ------------------------------------------------------------------------------------------------ backward
// (block_m, block_n, Q/dO stages) per head dim, on 8 warps.               docs/tuning.md#backward-tiles
// dK and dV live in registers for the whole CTA (2 * kBlockN * head_dim / 256 floats per thread), so wide heads get
// narrower key blocks, and one Q/dO buffer keeps shared memory under an A100's 163 KB. head_dim 64 takes 128 query
// rows per block (S/dP in two 64-row passes, traits.h): the dQ GEMM's warps get 32 x 32 slabs and a block pays its
// barriers once per 128 rows; one 128-row pass does not fit in registers beside dK and dV.
// The deep tile (BwdTile::kDeep, docs/tuning.md#backward-big-smem-stages): more Q/dO stages where a block may use more
// than an A100 allows (H100); d256's second stage needs 208 KB and pays there, as FA2 also chooses at run time, since
// with one stage the next Q/dO load is exposed at one CTA per SM. Other head dims: not measured.
// running_qdo (docs/tuning.md#running-source-tiles): Q and dO loaded from running source tiles instead of indexed
// per block. It moves registers, so it is per head dim: it pays at d128 (fewer spills), loses at d96 and d64 (ptxas
// schedules their loops worse) and is neutral at d256; others unmeasured.
constexpr BwdTileShape bwd_main_tile(int head_dim, bool deep = false) {
  const int stages = head_dim <= 128 ? 2 : 1;
  const int stages_big_smem = head_dim == 256 ? 2 : stages;
  return {head_dim, head_dim == 64 ? 128 : 64, head_dim <= 128 ? 128 : 64, deep ? stages_big_smem : stages,
          head_dim == 128, false};
}
constexpr bool bwd_has_deep_tile(int head_dim) {
  return bwd_main_tile(head_dim, true).stages != bwd_main_tile(head_dim).stages;
}

// The backward where the main tiles need more shared memory than a block may use: 99 KB GPUs at d64, d96,
// d128, d192, d224 and d256 (d32 and d160 fit as they are).                 docs/tuning.md#backward-small-smem
// Each takes the largest tiles that fit, then a second Q/dO stage if that fits too: 64 query rows, 128 keys at d64,
// 64 at d96/d128, 32 from d192. At d256 even 64 x 32 tiles need 104 KB, so P and dS move into the bytes of V
// (kPdSInV, traits.h), which then reloads with every query block. d224 runs that d256 kernel (kKernelHeadDim; the
// last 32 columns are masked, as for any head dim between compiled sizes): 8 warps cannot copy a 32-row tile of 224
// columns in whole passes (it is 3.5 of them), and 64 rows do not fit. These configurations are correct by test on
// the H100 (a forced limit) but not tuned: no 99 KB GPU is at hand.
constexpr bool bwd_has_small_smem_tile(int head_dim) { return head_dim != 32 && head_dim != 160; }
constexpr BwdTileShape bwd_small_smem_tile(int head_dim) {
  const int kernel_head_dim = head_dim == 224 ? 256 : head_dim;
  return {kernel_head_dim, 64, head_dim == 64 ? 128 : head_dim <= 128 ? 64 : 32, head_dim <= 96 ? 2 : 1, false,
          kernel_head_dim == 256};
}

constexpr BwdTileShape bwd_tile_shape(BwdTile tile, int head_dim) {
  return tile == BwdTile::kSmallSmem ? bwd_small_smem_tile(head_dim) : bwd_main_tile(head_dim, tile == BwdTile::kDeep);
}
// The warps own 32 x 32 dQ slabs (traits.h: kDqWarpSlabs): 8192-element dQ blocks with 128-key blocks.
constexpr bool bwd_dq_warp_slabs(BwdTileShape t) { return t.block_m * t.head_dim == 8 * 32 * 32 && t.block_n == 128; }
// A backward tile's dynamic shared memory (bwd_smem.h's order): Q and dO per stage, K, V, P and dS (none where they
// take V's bytes), in 2-byte elements; plus the warps' fp32 dQ slabs where the code that runs is sm90+ code
// (code_sm90), the only code that uses them. bwd_launch.h asserts it is the BwdTraits' of each tile.
constexpr int bwd_smem_bytes(BwdTileShape t, bool code_sm90) {
  const int elems = 2 * t.stages * t.block_m * t.head_dim + 2 * t.block_n * t.head_dim +
                    (t.pds_in_v ? 0 : 2 * t.block_m * t.block_n);
  return elems * 2 + (code_sm90 && bwd_dq_warp_slabs(t) ? t.block_m * t.head_dim * 4 : 0);
}
// Which tile a backward runs, the one rule the launch plan applies: the first whose shared memory fits, the deeper
// pipeline (kDeep), the main tile, then the 99 KB one (kSmallSmem). The main tile is the answer where none fits: its
// launch then says what the GPU lacks.
constexpr BwdTile bwd_tile_for(int head_dim, int smem_limit, bool code_sm90) {
  if (bwd_has_deep_tile(head_dim) && bwd_smem_bytes(bwd_main_tile(head_dim, true), code_sm90) <= smem_limit) {
    return BwdTile::kDeep;
  }
  if (bwd_has_small_smem_tile(head_dim) && bwd_smem_bytes(bwd_main_tile(head_dim), code_sm90) > smem_limit) {
    return BwdTile::kSmallSmem;
  }
  return BwdTile::kMain;
}

// How the backward brings one key block's share of dQ (fp32, in the MMA's layout) to the global accumulator
// (dq_accum.h).                                                             docs/tuning.md#dq-path
// Scalar atomics on the MMA layout touch half-used sectors and make the backward L2-bound; instead:
//   kWarpSlabs    each warp re-tiles its own 32 x 32 slab (traits.h: kDqWarpSlabs) into float4 rows and adds them
//                 with float4 atomics, with no CTA barrier; sm90 code only (vector atomics, and the launch gives
//                 sm90 code the slabs' shared memory);
//   kStagedInPdS  dQ re-tiled CTA-wide through the bytes of sP and sdS (free once the GEMMs are done), then each
//                 thread adds 4 consecutive floats (float4 atomics on sm90, coalesced scalars on sm80);
//   kDirect       the MMA's column pairs added where they are: float2 atomics on sm90 (4 threads fill a 32-byte
//                 sector), scalar pairs on sm80.
// Warp slabs wherever the warps own them: no barrier beats the others' savings. Elsewhere staging at head_dim <= 64,
// where the atomics are a large share of the time, and direct float2 atomics above, where the staging's two
// barriers and shared-memory traffic cost more than the atomic instructions they save. Without vector atomics
// (sm80) staging wherever dQ fits in sP and sdS.
enum class DqPath { kWarpSlabs, kStagedInPdS, kDirect };
// sm90: the code is compiled for sm90 or later; warp_slabs: the warps own 32 x 32 dQ slabs; fits_in_pds: the block's
// fp32 dQ tile fits in the bytes of sP and sdS.
constexpr DqPath dq_path_for(bool sm90, bool warp_slabs, bool fits_in_pds, int head_dim) {
  if (sm90 && warp_slabs) return DqPath::kWarpSlabs;
  return (!sm90 || head_dim <= 64) && fits_in_pds ? DqPath::kStagedInPdS : DqPath::kDirect;
}
// With direct atomics, the dQ GEMM and its atomics go between the dV and dK GEMMs: the atomics drain while the dK
// MMAs run, not just before the next block's barrier. The warp slabs gain nothing from it and keep dQ last; the
// CTA-wide staging must come last (dK reads sdS, whose bytes it takes).    docs/tuning.md#dq-order
constexpr bool dq_before_dk(DqPath path) { return path == DqPath::kDirect; }

// The backward's two row-wise kernels (preprocess: D and the zeroed dQ accumulator; convert: dQ in the input dtype)
// give each row the fewest lanes that cover it in 16-byte chunks, a power of two (64-dim rows: 8 lanes, 4 rows per
// warp), so no lane idles on a short row. kRowKernelWarps per CTA: both kernels stream memory, and the CTA size was
// not tuned.                                                                docs/tuning.md#row-kernels
__host__ __device__ constexpr int row_lanes(int head_dim) {
  int lanes = 1;
  while (lanes < 32 && lanes * 8 < head_dim) lanes *= 2;
  return lanes;
}
constexpr int kRowKernelWarps = 4;

// ------------------------------------------------------------------------------------------------ both
// Causal grids dispatch the heaviest blocks first (schedule.h), within groups of this many heads: as many heads as
// have blocks resident at once anyway, so the heads whose K/V (or Q/dO) are in flight stay those of the plain
// order and keep sharing L2, while the grid's tail gets shorter. Rounded down to a divisor of nheads.
//                                                                           docs/tuning.md#causal-order
constexpr int causal_head_group(int nheads, int resident_ctas, int blocks_per_head) {
  const int resident_heads = (resident_ctas + blocks_per_head - 1) / blocks_per_head;
  int group = resident_heads < nheads ? resident_heads : nheads;
  while (nheads % group != 0) --group;
  return group;
}

}  // namespace fa2
