// Which (block, head) a CTA works on. CTAs are dispatched in blockIdx order (x fastest), so the grid order
// is the schedule. Causal grids have blocks of unequal cost; handing out the heaviest first keeps the
// grid's tail short (longest-processing-time first). Doing that across all heads of a batch loses L2:
// CTAs that run side by side then read different heads' K/V. So heads go in groups of p.head_group, as
// many as are resident at once anyway (the launch plan sets it: sm80/config.h causal_head_group;
// docs/tuning.md#causal-order): within a group the heaviest blocks of all its heads go first, and the group's K/V
// stay in L2 as before. head_group 0: the plain order (not causal).
#pragma once

#include "common/params.h"

namespace fa2 {

struct BlockHead {
  int block, head;
};

// kHeavyLast: the heaviest block has the highest index (forward: a query block sees more keys the later
// it is); otherwise block 0 is the heaviest (backward: key block 0 is seen by every query).
// (x, y): the CTA's place in the dispatch order, blockIdx unless the kernel draws it from a ticket.
template <bool kHeavyLast>
__device__ __forceinline__ BlockHead scheduled_block(int head_group, int x, int y) {
  if (head_group == 0) return {x, y};
  const int group = head_group;
  const int rank = x + int(gridDim.x) * (y % group);  // dispatch order within the group
  const int heaviness = rank / group;                 // 0 = heaviest
  return {kHeavyLast ? int(gridDim.x) - 1 - heaviness : heaviness, y - y % group + rank % group};
}

template <bool kHeavyLast>
__device__ __forceinline__ BlockHead scheduled_block(int head_group) {
  return scheduled_block<kHeavyLast>(head_group, int(blockIdx.x), int(blockIdx.y));
}

template <bool kHeavyLast>
__device__ __forceinline__ BlockHead scheduled_block(FwdParams const& p) {
  return scheduled_block<kHeavyLast>(p.head_group);
}

}  // namespace fa2
