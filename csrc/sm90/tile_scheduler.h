// Which (query block, head, batch entry) a persistent CTA computes next. The grid holds one CTA per SM. CTA c starts
// with tile c; each later tile is the next one nobody has taken (an atomic counter), so a CTA that drew light tiles
// takes more of them: greedy longest-first, whose tail stays short.      docs/tuning.md#sm90-forward
//
// The order: query blocks fastest, so the CTAs running at one time read the same head's K and V (L2 hits), where
// every query block has about the same work (plain attention, sliding windows). Where the band has a right edge and
// no left one (causal), the last query blocks see the most keys: heaviest first, within sections of `section`
// (head, batch) pairs whose K and V fit in L2 together (heaviest-first over the whole grid would have every CTA read
// another head's K and V, from memory).
#pragma once

#include <cute/config.hpp>

namespace fa2::sm90 {

struct WorkTile {
  int m_block, head, batch;
};

struct TileScheduler {
  int num_m, nheads, batch;
  int section;       // heavy_first: (head, batch) pairs per section, >= 1
  bool heavy_first;  // the band has a right edge and no left one

  CUTE_HOST_DEVICE int num_tiles() const { return num_m * nheads * batch; }

  CUTE_HOST_DEVICE WorkTile tile(int t) const {
    int hb, m_block;
    if (heavy_first) {
      const int per_section = section * num_m, first = t / per_section * section;
      const int width = cute::min(section, nheads * batch - first), within = t % per_section;
      hb = first + within % width;
      m_block = num_m - 1 - within / width;
    } else {
      hb = t / num_m;
      m_block = t - hb * num_m;
    }
    return {m_block, hb % nheads, hb / nheads};
  }
};

// A tile index handed from a persistent kernel's producer to its other warps through shared memory: the mbarrier's
// arrive releases it and its wait acquires it, and the compiler must not move the access across them (their asm
// names no memory).
__device__ __forceinline__ void publish_tile(int& slot, int t) {
  *reinterpret_cast<volatile int*>(&slot) = t;
  asm volatile("" ::: "memory");
}
__device__ __forceinline__ int read_tile(const int& slot) {
  asm volatile("" ::: "memory");
  return *reinterpret_cast<const volatile int*>(&slot);
}

}  // namespace fa2::sm90
