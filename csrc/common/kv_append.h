// A decode step's new keys and values written into a KV cache before the attention reads it
// (fa2.attention_with_kvcache): row s of sequence b's k_new and v_new becomes row cache.seqlens[b] + s of its cache,
// wherever seqlen.h's cache_row_offset puts that row (its batch entry, or its page). A row that would land past the
// cache's capacity is not written. Rows move as 16-byte chunks; with a rotary embedding (params.h: KvAppendParams)
// the new keys' chunks are rotated on the way, and the same grid rotates q into q_rotated, so that q and the new keys
// are each read and rotated once (fa2.reference.apply_rotary is the formula).
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/params.h"
#include "common/pdl.h"
#include "common/seqlen.h"

namespace fa2 {

constexpr int kAppendThreads = 128;

// The parts of a row (gridDim.z): enough blocks that each thread moves one 16-byte chunk of the row: q's chunks
// (where q is rotated) and k_new's and v_new's side by side, so that a rotated decode step waits for one chain of
// loads (its position, then the row with its cosines and sines), not for q's and then the keys' (+15% at batch 1).
inline int kv_append_parts(const KvAppendParams& p) {
  const int chunks_per_head = p.row_bytes / 16;
  const int q_chunks = p.rotary_dim > 0 && p.seqlen_q > 0 ? p.nheads * chunks_per_head : 0;
  return (q_chunks + 2 * p.nheads_k * chunks_per_head + kAppendThreads - 1) / kAppendThreads;
}

__device__ __forceinline__ float half_bits_to_float(uint16_t x, bool bf16) {
  return bf16 ? __bfloat162float(__ushort_as_bfloat16(x)) : __half2float(__ushort_as_half(x));
}
__device__ __forceinline__ uint16_t float_to_half_bits(float x, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}

// Chunk `chunk` (elements [8 * chunk, 8 * chunk + 8)) of one head's row `src`, rotated at `position` (already
// clamped to cos/sin's rows). A non-interleaved pair's partner may sit in another chunk: it is read from `src` (the
// same row, which the neighbouring threads are reading, so from L1). Where the chunk lies inside rotary_dim and the
// rows of cos and sin are 16-byte aligned (rotary_dim a multiple of 16, as flash-attn requires, and aligned bases),
// the partner, cosines and sines arrive as one vector load each; otherwise element by element. No branch before the
// loads of the chunk and its partner depends on `position`, so that they go out beside the load of the position
// (cache.seqlens) and only the cosines and sines wait for it (docs/tuning.md#pdl).
__device__ __forceinline__ uint4 rotated_chunk(KvAppendParams const& p, const uint16_t* src, int chunk,
                                               int64_t position) {
  const uint4 packed = *reinterpret_cast<const uint4*>(src + 8 * chunk);
  const int j0 = 8 * chunk, half = p.rotary_dim / 2;
  if (j0 >= p.rotary_dim) return packed;
  const auto* cos = static_cast<const uint16_t*>(p.rotary_cos) + position * half;
  const auto* sin = static_cast<const uint16_t*>(p.rotary_sin) + position * half;
  uint16_t x[8], y[8], partner[8], c[8], sn[8];
  memcpy(x, &packed, 16);
  // A row starts position * rotary_dim bytes after the table's start: 16-byte aligned wherever the start is.
  const bool aligned = p.rotary_dim % 16 == 0 && ((reinterpret_cast<uintptr_t>(p.rotary_cos) |
                                                   reinterpret_cast<uintptr_t>(p.rotary_sin)) & 15) == 0;
  if (aligned && !p.interleaved) {  // the chunk is all in one half; its partner is the chunk half / 8 away
    const bool first = j0 < half;
    const int i0 = first ? j0 : j0 - half;
    const uint4 other = *reinterpret_cast<const uint4*>(src + (first ? j0 + half : j0 - half));
    const uint4 cv = *reinterpret_cast<const uint4*>(cos + i0), sv = *reinterpret_cast<const uint4*>(sin + i0);
    memcpy(partner, &other, 16), memcpy(c, &cv, 16), memcpy(sn, &sv, 16);
  } else if (aligned) {  // interleaved: pairs inside the chunk, four angles
    const uint2 cv = *reinterpret_cast<const uint2*>(cos + j0 / 2), sv = *reinterpret_cast<const uint2*>(sin + j0 / 2);
    uint16_t c4[4], s4[4];
    memcpy(c4, &cv, 8), memcpy(s4, &sv, 8);
#pragma unroll
    for (int e = 0; e < 8; ++e) partner[e] = x[e ^ 1], c[e] = c4[e / 2], sn[e] = s4[e / 2];
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int j = min(j0 + e, p.rotary_dim - 1);  // elements past rotary_dim are copied below
      const bool first = p.interleaved ? (e % 2 == 0) : j < half;
      const int i = p.interleaved ? j / 2 : (first ? j : j - half);
      partner[e] = p.interleaved ? x[e ^ 1] : src[first ? j + half : j - half];
      c[e] = cos[i], sn[e] = sin[i];
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int j = j0 + e;
    // Element j pairs with partner: y_j = x_j cos - partner sin for the pair's first, x_j cos + partner sin for its
    // second (reference.apply_rotary).
    const bool first = p.interleaved ? (e % 2 == 0) : j < half;
    const float xj = half_bits_to_float(x[e], p.bf16), xp = half_bits_to_float(partner[e], p.bf16);
    const float cj = half_bits_to_float(c[e], p.bf16), sj = half_bits_to_float(sn[e], p.bf16);
    y[e] = j >= p.rotary_dim ? x[e] : float_to_half_bits(first ? xj * cj - xp * sj : xj * cj + xp * sj, p.bf16);
  }
  uint4 out;
  memcpy(&out, y, 16);
  return out;
}

// Blocks (row, sequence, part): q's row s (rotated into q_rotated) where q is rotated, and k_new's and v_new's row s
// where s is a new row; the gridDim.z parts' threads share the row's heads, 16 bytes each, so that a decode step of
// one sequence (one row) still spreads its chunks over the GPU rather than looping in one block.
__global__ void __launch_bounds__(kAppendThreads) kv_append_kernel(const __grid_constant__ KvAppendParams p) {
  let_next_kernel_launch();  // the forward's prologue may run beside this grid (pdl.h); it waits for it to end
  const int s = blockIdx.x, batch = blockIdx.y;
  const int start = blockIdx.z * kAppendThreads + threadIdx.x, stride = gridDim.z * kAppendThreads;
  const int64_t held = p.cache.seqlens != nullptr ? p.cache.seqlens[batch] : p.cache.seqlen;
  const int chunks_per_head = p.row_bytes / 16;
  const int64_t last_position = int64_t(p.seqlen_ro) - 1;
  // Items [0, q_chunks) are q's row s, the rest k_new's and then v_new's row s.
  const int q_chunks = p.rotary_dim > 0 && p.seqlen_q > 0 ? p.nheads * chunks_per_head : 0;
  const int chunks = p.nheads_k * chunks_per_head;
  const int64_t row = held + s;
  for (int i = start; i < q_chunks + 2 * chunks; i += stride) {
    if (i < q_chunks) {
      if (s >= p.seqlen_q) continue;
      const int64_t position = min(max(held + (p.q_per_row ? s : 0), int64_t(0)), last_position);
      const int head = i / chunks_per_head, chunk = i % chunks_per_head;
      const auto* src = static_cast<const uint16_t*>(p.q) + batch * p.q_stride.batch + s * p.q_stride.row +
                        head * p.q_stride.head;
      auto* dst = static_cast<uint16_t*>(p.q_rotated) + batch * p.q_rotated_stride.batch +
                  s * p.q_rotated_stride.row + head * p.q_rotated_stride.head;
      *reinterpret_cast<uint4*>(dst + 8 * chunk) = rotated_chunk(p, src, chunk, position);
      continue;
    }
    if (s >= p.cache.appended) continue;
    const int kv = i - q_chunks;
    const bool is_v = kv >= chunks;
    const int head = (kv % chunks) / chunks_per_head, chunk = kv % chunks_per_head;
    const Strides& src_st = is_v ? p.v_new_stride : p.k_new_stride;
    const Strides& dst_st = is_v ? p.v_cache_stride : p.k_cache_stride;
    // Strides count 2-byte elements; a chunk is 8 of them. The key's position is its cache row.
    const auto* src = static_cast<const uint16_t*>(is_v ? p.v_new : p.k_new) + batch * src_st.batch + s * src_st.row +
                      head * src_st.head;
    // Read (and rotated) before the row is checked, so that the reads wait for no branch on the position.
    const uint4 chunk_out = is_v || p.rotary_dim == 0
                                ? *reinterpret_cast<const uint4*>(src + 8 * chunk)
                                : rotated_chunk(p, src, chunk, max(min(row, last_position), int64_t(0)));
    if (row < 0 || row >= p.cache.capacity) continue;
    auto* dst = static_cast<uint16_t*>(is_v ? p.v_cache : p.k_cache) +
                cache_row_offset(p.cache, dst_st, batch, int(row)) + head * dst_st.head + 8 * chunk;
    *reinterpret_cast<uint4*>(dst) = chunk_out;
  }
}

}  // namespace fa2
