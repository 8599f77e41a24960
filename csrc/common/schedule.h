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
// (x, y): the work's place in the dispatch order of a (blocks, heads) grid: blockIdx, or a ticket or a persistent
// CTA's tile (sm90/bwd_kernel.h) taken apart as blockIdx would be.
template <bool kHeavyLast>
__device__ __forceinline__ BlockHead scheduled_block(int head_group, int x, int y, int blocks) {
  if (head_group == 0) return {x, y};
  const int group = head_group;
  const int rank = x + blocks * (y % group);  // dispatch order within the group
  const int heaviness = rank / group;         // 0 = heaviest
  return {kHeavyLast ? blocks - 1 - heaviness : heaviness, y - y % group + rank % group};
}

template <bool kHeavyLast>
__device__ __forceinline__ BlockHead scheduled_block(int head_group) {
  return scheduled_block<kHeavyLast>(head_group, int(blockIdx.x), int(blockIdx.y), int(gridDim.x));
}

template <bool kHeavyLast>
__device__ __forceinline__ BlockHead scheduled_block(FwdParams const& p) {
  return scheduled_block<kHeavyLast>(p.head_group);
}

// Deterministic backward, full attention, rotated walk (sm90/bwd_kernel.h): key block n of N visits the M query
// blocks starting at n mod M and wrapping, so it reaches block r at step t(n, r) = (r - n) mod M, and its turn at r is
// its rank in that arrival order (ties: lower n first). The key blocks ahead of n are those of the t residues after
// n's (n%M + 1 .. n%M + t, mod M) plus n - M, n - 2M, .. (same step, lower n). With P(k) = #{n' < N : n' mod M < k}
// = k (N / M) + min(k, N % M), those residues hold P(r + 1) - P(n%M + 1) key blocks, + N where they wrap past M
// (r < n%M). O(1) a block; the divisions once a CTA. bench/det_rotate.cu checks it against brute force.
struct RotatedTurns {
  int per_residue, extra, n_mod, n_total, base;  // N / M, N % M, n % M, N, n / M - P(n%M + 1)
  __host__ __device__ RotatedTurns(int n, int n_blocks, int m_blocks)
      : per_residue(n_blocks / m_blocks), extra(n_blocks % m_blocks), n_mod(n % m_blocks), n_total(n_blocks),
        base(n / m_blocks - prefix(n % m_blocks + 1)) {}
  __host__ __device__ int prefix(int k) const { return k * per_residue + (k < extra ? k : extra); }
  // r: the query block less the walk's first (m - m_begin), in [0, M).
  __host__ __device__ int operator()(int r) const { return prefix(r + 1) + (r < n_mod ? n_total : 0) + base; }
};

}  // namespace fa2
