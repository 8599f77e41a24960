// Where the rows of one batch entry live, for padded and packed (varlen) batches alike: the kernels
// ask this, never the params, for a sequence's lengths and offsets.
#pragma once

#include <cute/tensor.hpp>

#include "common/params.h"

namespace fa2 {
using namespace cute;

// A KV cache's rows (params.h: KvCache). Every index read from the caller's tensors is clamped to their bounds.
// The cache entry (dim 0) of sequence `batch`'s rows in an unpaged cache.
__device__ __forceinline__ int cache_entry(KvCache const& c, int batch) {
  return c.batch_index == nullptr ? batch : min(max(c.batch_index[batch], 0), c.cache_batch - 1);
}
// The element offset of row `row` of sequence `batch` (head 0) in a cache tensor with strides st.
__device__ __forceinline__ int64_t cache_row_offset(KvCache const& c, Strides const& st, int batch, int row) {
  if (c.block_table == nullptr) return cache_entry(c, batch) * st.batch + row * st.row;
  const int page = min(max(c.block_table[int64_t(batch) * c.block_table_stride + row / c.page_size], 0),
                       c.cache_batch - 1);
  return page * st.batch + (row % c.page_size) * st.row;
}

// The page of a key block that a paged cache's running source tile (fwd_kernel.h) is on, stepped one block down at
// a time. The block table is read once per page, one page ahead: a step that crosses into the next page down has its
// id in a register already, instead of waiting on a table load (and a division by the page size) before the block's
// copies can be issued.
template <int kBlockN>
struct PageCursor {
  // The current block: block `block` of the page at index `index` of the sequence's block-table row; `page` and
  // `next_page` are that entry and the one before it, clamped. The table's address and the page geometry are
  // recomputed from the parameters when needed, so the cursor holds four registers.
  int index = 0, block = 0, page = 0, next_page = 0;

  PageCursor() = default;
  // At block n_block. `lanes`: row_lanes()'s value, whose shuffle serves the first lookups when the row is short.
  __device__ __forceinline__ PageCursor(KvCache const& c, int batch, int n_block, int lanes)
      : index(n_block / blocks_per_page(c)), block(n_block - index * blocks_per_page(c)),
        page(read(c, batch, index, lanes)), next_page(read(c, batch, index - 1, lanes)) {}

  static __device__ __forceinline__ int blocks_per_page(KvCache const& c) { return c.page_size / kBlockN; }
  // Entry `lane` of sequence `batch`'s table row (0 past the row's end), read where the kernel starts, beside
  // cache_seqlens: the cursor's first lookup, whose index waits for the sequence's length, then takes a shuffle
  // instead of a dependent global read (docs/tuning.md#paged-kv).
  static __device__ __forceinline__ int row_lanes(KvCache const& c, int batch) {
    const int lane = int(threadIdx.x) % 32;
    return int64_t(lane) * c.page_size < c.capacity ? c.block_table[int64_t(batch) * c.block_table_stride + lane] : 0;
  }
  static __device__ __forceinline__ int read(KvCache const& c, int batch, int i, int lanes) {
    const int near = __shfl_sync(0xffffffffu, lanes, i & 31);  // i is the same in every lane
    return i < 0 ? 0 : min(max(i < 32 ? near : global(c, batch, i), 0), c.cache_batch - 1);
  }
  static __device__ __forceinline__ int read(KvCache const& c, int batch, int i) {
    return i < 0 ? 0 : min(max(global(c, batch, i), 0), c.cache_batch - 1);
  }
  static __device__ __forceinline__ int global(KvCache const& c, int batch, int i) {
    return c.block_table[int64_t(batch) * c.block_table_stride + i];
  }
  // The current block's first row, in elements of a cache tensor with strides st (head 0).
  __device__ __forceinline__ int64_t offset(Strides const& st) const {
    return page * st.batch + int64_t(block * kBlockN) * st.row;
  }
  // Elements from cursor `from`'s block to this one's, one block down (block_step: a block's rows): within a page
  // that is an unpaged cache's step, and the 64-bit offsets are computed only where the page changes, once a page.
  __device__ __forceinline__ int64_t step_from(PageCursor const& from, Strides const& st, int64_t block_step) const {
    return index == from.index ? -block_step : offset(st) - from.offset(st);
  }
  __device__ __forceinline__ void step_down(KvCache const& c, int batch) {
    if (block > 0) {
      --block;
    } else {
      --index, block = blocks_per_page(c) - 1, page = next_page;
      next_page = read(c, batch, index - 1);
    }
  }
};

// Sequence `batch`'s tokens [start, start + len) of a packed tensor of `total` tokens (cu: cu_seqlens). Clamped so that
// a corrupt cu_seqlens can never address outside the tensor, and cut at the max_seqlen that sized the grid. The Python
// layer reports bad values once per cu_seqlens pair (ops.check_cu_seqlens_values); this keeps the kernels memory-safe
// whatever they hold. Every family reads a packed sequence's bounds here.
struct PackedSpan {
  int start, len;
};
__device__ __forceinline__ PackedSpan packed_span(const int* cu, int batch, int total, int max_len) {
  const int begin = min(max(cu[batch], 0), total);
  const int end = min(max(cu[batch + 1], begin), total);
  return {begin, min(end - begin, max_len)};
}

struct SeqInfo {
  int seqlen_q, seqlen_k;    // this sequence's lengths
  int kv_batch;              // the batch entry of its k and v: its own, a KV cache's batch_index one, or 0 when paged
  int64_t q_start, k_start;  // its first token in a packed tensor (0 for padded batches)
  int64_t stats_row;         // row 0 of this (batch, head) in lse, d_sum and dq_accum

  __device__ __forceinline__ SeqInfo(FwdParams const& p, int batch, int head) {
    kv_batch = batch;
    if (p.cu_seqlens_q == nullptr) {
      seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
      if (p.cache.seqlens != nullptr) {
        seqlen_k = int(min(max(int64_t(p.cache.seqlens[batch]) + p.cache.appended, int64_t(0)), int64_t(p.seqlen_k)));
      }
      // Paged: the kernel adds each key block's page offset (PageCursor) to page 0's rows.
      kv_batch = p.cache.block_table != nullptr ? 0 : cache_entry(p.cache, batch);
      q_start = 0, k_start = 0;
      if (p.cache.leftpad != nullptr) {  // the keys start at the pad's end (an unpaged cache: params.h)
        k_start = min(max(p.cache.leftpad[batch], 0), seqlen_k);
        seqlen_k -= int(k_start);
      }
      stats_row = (int64_t(batch) * p.nheads + head) * p.seqlen_q;
      return;
    }
    const PackedSpan q = packed_span(p.cu_seqlens_q, batch, p.total_q, p.seqlen_q);
    const PackedSpan k = packed_span(p.cu_seqlens_k, batch, p.total_k, p.seqlen_k);
    seqlen_q = q.len, seqlen_k = k.len;
    q_start = q.start, k_start = k.start;
    stats_row = int64_t(head) * p.total_q + q.start;
  }

  // This sequence's (seqlen, kHeadDim) slice of one head of a q-side (q, o, dO, dQ) or k-side (k, v, dK, dV)
  // tensor. Strides are 64-bit, so offsets past 2^31 elements are fine.
  template <int kHeadDim, typename Element, typename Void>
  __device__ __forceinline__ auto q_tensor(Void* base, Strides const& st, int batch, int head) const {
    return slice<kHeadDim, Element>(base, st, batch, q_start, head, seqlen_q);
  }
  template <int kHeadDim, typename Element, typename Void>
  __device__ __forceinline__ auto k_tensor(Void* base, Strides const& st, int batch, int head) const {
    return slice<kHeadDim, Element>(base, st, batch, k_start, head, seqlen_k);
  }

 private:
  template <int kHeadDim, typename Element, typename Void>
  __device__ __forceinline__ static auto slice(Void* base, Strides const& st, int batch, int64_t start, int head,
                                               int len) {
    auto ptr = static_cast<Element*>(base) + batch * st.batch + start * st.row + head * st.head;
    return make_tensor(make_gmem_ptr(ptr), make_shape(len, Int<kHeadDim>{}), make_stride(st.row, _1{}));
  }
};

}  // namespace fa2
