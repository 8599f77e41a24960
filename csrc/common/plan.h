// A launch plan: everything the host decides about how one call runs, decided once (host/plan.cpp) from the kernel
// families' tables (sm80/config.h) and executed by the family's launch (sm80/fwd_launch.h, sm80/bwd_launch.h), which
// re-decides none of it. Record mode (csrc/CONTRACT.md) hands the plan to the tests, and build_info() names the
// families a build has. Plain structs: no torch, no CuTe, nothing of a family's layouts.
#pragma once

#include "common/dtype.h"

namespace fa2 {

// The kernel families. kSm80: the mma.sync kernels (sm80 atoms), which run on every GPU fa2 supports. kSm90: the
// Hopper kernels (wgmma, TMA, warp specialization; sm_90a code), on compute capability 9.0 for what they serve.
enum class Family { kSm80, kSm90 };

// The forward's tiles (sm80/config.h): the main one, FA2's narrow 64 x 64 one (short d256 sequences, 99 KB GPUs;
// decodes and paged caches at d160/d224/d256), and the decode one (decodes and paged caches at d64/d128).
enum class FwdTile { kMain, kNarrow, kDecode };

// The per-score transforms a forward instance compiles in; the plan picks the smallest that covers the call
// (docs/tuning.md#features-off). A window's left edge goes with them (kNone masks causal's and seqlen_k's edges only),
// and split-KV with kLogits alone (a call with dropout is never split). The 64-row tiles have the kLogits instance, and
// the narrow one at d224/d256 the kAll one for calls with dropout.
enum class ScoreTransforms {
  kNone,
  kLogits,  // softcap, ALiBi, a left edge, split-KV
  kAll,     // kLogits' transforms and dropout; no split-KV
};

// The backward's tiles (sm80/config.h): the main one, a deeper Q/dO pipeline where a block may use more shared memory
// than an A100 allows, and the 99 KB one.
enum class BwdTile { kMain, kDeep, kSmallSmem };

// A forward tile's geometry, as the family's table lists it.
struct FwdTileShape {
  int block_m, block_n, warps, stages;
};

// A backward tile's: head_dim is the kernel's (the 99 KB tile runs d224 on the d256 kernel).
struct BwdTileShape {
  int head_dim, block_m, block_n, stages;
  bool running_qdo, pds_in_v;
};

struct FwdPlan {
  Family family = Family::kSm80;
  int head_dim = 0;  // the compiled head dim that runs (>= the call's; the kernel masks the padding columns)
  DType dtype = DType::bf16;
  FwdTile tile = FwdTile::kMain;
  FwdTileShape shape = {};
  ScoreTransforms transforms = ScoreTransforms::kNone;
  int num_splits = 1;     // split-KV (sm80/config.h: fwd_num_splits); also FwdParams::num_splits
  bool pack_gqa = false;  // a GQA decode's query heads packed into the rows of one block (host/plan.cpp)
  bool paged = false;     // the K/V are a paged cache
  int head_group = 0;     // causal: heads dispatched heaviest block first together (common/schedule.h); 0: plain order
  // The device code is sm90's (the mma.sync family's arch-90 build): the forward behind a KV append, and the split-KV
  // combine behind the forward, start early and wait in their prologue (common/pdl.h).
  bool pdl = false;
};

struct BwdPlan {
  Family family = Family::kSm80;
  int head_dim = 0;
  DType dtype = DType::bf16;
  BwdTile tile = BwdTile::kMain;
  BwdTileShape shape = {};
  int head_group = 0;  // causal: heads (Hopper: walks) dispatched heaviest block first together; 0: plain order
  // The Hopper backward: query heads of one K/V group a tile walks, dK and dV summed in registers (host/plan.cpp);
  // the mma.sync backward: 1 (a tile per query head, the group summed after the kernel).
  int walk_heads = 1;
};

}  // namespace fa2
