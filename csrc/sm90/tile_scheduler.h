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

#include <type_traits>

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

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

  // The grid index of tile w: tile()'s inverse.
  CUTE_HOST_DEVICE int index(WorkTile w) const {
    const int hb = w.batch * nheads + w.head;
    if (!heavy_first) return hb * num_m + w.m_block;
    const int first = hb / section * section, width = cute::min(section, nheads * batch - first);
    return first * num_m + (num_m - 1 - w.m_block) * width + (hb - first);
  }
};

// Packed sequences (varlen): the grid covers the longest sequence's query blocks for every sequence, so most of its
// tiles can lie past their sequence's end. The producer draws real tiles only: r numbers them sequence by sequence
// from `blocks` (blocks[b]: the query blocks of the sequences before b, fwd_launch.h: varlen_tile_prefix), within a
// sequence in the grid's order (plain: each head's blocks in turn; heaviest first: every head's last block first).
// Returns the grid index of real tile r, which the producer decodes as for a padded batch, or num_tiles() past the
// last one. Each draw was an atomic round trip per empty tile before (docs/tuning.md#sm90-forward).
CUTE_HOST_DEVICE int varlen_tile(TileScheduler const& s, const int* blocks, int r) {
  const int nheads = s.nheads;
  if (r >= blocks[s.batch] * nheads) return s.num_tiles();
  int lo = 0, hi = s.batch;  // blocks[lo] * nheads <= r < blocks[hi] * nheads
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (blocks[mid] * nheads <= r) lo = mid; else hi = mid;
  }
  const int count = blocks[lo + 1] - blocks[lo], local = r - blocks[lo] * nheads;
  return s.index(s.heavy_first ? WorkTile{count - 1 - local / nheads, local % nheads, lo}
                               : WorkTile{local % count, local / count, lo});
}

// A persistent kernel's tiles, handed from its producer warp to the warps that compute them through shared memory.
// Two slots, so that the producer may draw one tile ahead: the CTA's i-th tile travels in slot i % 2, and a tile past
// the last tells the readers to stop. An Item is the tile's grid index, or what the producer already worked out about
// it (the forward's FwdWork), so that the readers do not take it apart again at every tile's start. The slot's
// mbarrier arrive releases the item and its wait acquires it; the compiler must not move the accesses across them
// (their asm names no memory), hence the volatile word copies and fences.
template <class Item = int>
struct TileMailbox {
  static_assert(sizeof(Item) % sizeof(int) == 0 && alignof(Item) % alignof(int) == 0 &&
                    std::is_trivially_copyable_v<Item>, "copied as ints");
  static constexpr int kWords = sizeof(Item) / sizeof(int);
  alignas(16) cutlass::arch::ClusterBarrier full[2];   // a slot written (the producer)
  alignas(16) cutlass::arch::ClusterBarrier empty[2];  // a slot read (every reader)
  int items[2][kWords];

  CUTE_DEVICE void init(int readers) {
    for (int s = 0; s < 2; ++s) full[s].init(1), empty[s].init(readers);
  }
  // The producer: the CTA's i-th tile is `item` (waits until every reader took tile i - 2 from the slot).
  CUTE_DEVICE void put(int i, Item const& item) {
    if (i >= 2) empty[i & 1].wait(((i >> 1) - 1) & 1);
    const int* from = reinterpret_cast<const int*>(&item);
    CUTE_UNROLL
    for (int k = 0; k < kWords; ++k) reinterpret_cast<volatile int*>(items[i & 1])[k] = from[k];
    asm volatile("" ::: "memory");
    full[i & 1].arrive();
  }
  // Every reader, once per tile, in order.
  CUTE_DEVICE Item take(int i) {
    full[i & 1].wait((i >> 1) & 1);
    asm volatile("" ::: "memory");
    Item item;
    int* to = reinterpret_cast<int*>(&item);
    CUTE_UNROLL
    for (int k = 0; k < kWords; ++k) to[k] = reinterpret_cast<const volatile int*>(items[i & 1])[k];
    asm volatile("" ::: "memory");
    empty[i & 1].arrive();
    return item;
  }
};

// Every word of `item` as lane 0 holds it: a shuffle from a constant lane is what ptxas reads as warp-uniform.
template <class Item>
CUTE_DEVICE Item warp_uniform(Item item) {
  static_assert(sizeof(Item) % sizeof(int) == 0 && alignof(Item) % alignof(int) == 0 &&
                    std::is_trivially_copyable_v<Item>, "copied as ints");
  int* words = reinterpret_cast<int*>(&item);
  CUTE_UNROLL
  for (int k = 0; k < int(sizeof(Item) / sizeof(int)); ++k) words[k] = __shfl_sync(0xffffffff, words[k], 0);
  return item;
}

}  // namespace fa2::sm90
