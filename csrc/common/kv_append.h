// A decode step's new keys and values written into a KV cache before the attention reads it
// (fa2.attention_with_kvcache): row s of sequence b's k_new and v_new becomes row cache.seqlens[b] + s of its cache,
// wherever seqlen.h's cache_row_offset puts that row (its batch entry, or its page). A row that would land past the
// cache's capacity is not written. Element-type blind: rows move as 16-byte chunks.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/params.h"
#include "common/seqlen.h"

namespace fa2 {

constexpr int kAppendThreads = 128;

// One block per (new row, sequence); its threads cover the row's heads of k and then of v, 16 bytes each.
__global__ void __launch_bounds__(kAppendThreads) kv_append_kernel(const __grid_constant__ KvAppendParams p) {
  const int s = blockIdx.x, batch = blockIdx.y;
  const int64_t row = int64_t(p.cache.seqlens != nullptr ? p.cache.seqlens[batch] : p.cache.seqlen) + s;
  if (row < 0 || row >= p.cache.capacity) return;
  const int chunks_per_head = p.row_bytes / 16, chunks = p.nheads_k * chunks_per_head;
  for (int i = threadIdx.x; i < 2 * chunks; i += kAppendThreads) {
    const bool is_v = i >= chunks;
    const int head = (i % chunks) / chunks_per_head, chunk = i % chunks_per_head;
    const Strides& src_st = is_v ? p.v_new_stride : p.k_new_stride;
    const Strides& dst_st = is_v ? p.v_cache_stride : p.k_cache_stride;
    // Strides count 2-byte elements; a chunk is 8 of them.
    const auto* src = static_cast<const uint16_t*>(is_v ? p.v_new : p.k_new) + batch * src_st.batch + s * src_st.row +
                      head * src_st.head + 8 * chunk;
    auto* dst = static_cast<uint16_t*>(is_v ? p.v_cache : p.k_cache) +
                cache_row_offset(p.cache, dst_st, batch, int(row)) + head * dst_st.head + 8 * chunk;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  }
}

}  // namespace fa2
