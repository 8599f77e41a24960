// Where a batch entry's rows are, as the Hopper kernels' TMA views (tma_rows_view, below) address them: a padded
// batch's rows as they are; a packed sequence's (varlen, common/seqlen.h: packed_span) row r at row coordinate
// r + shift of batch coordinate `coord`, so that the views' row bound is the sequence's end (loads past it bring
// zeros, stores and reduce-adds past it write nothing).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "common/params.h"
#include "common/seqlen.h"

namespace fa2::sm90 {

// The view of q, k, v, o, dout or dq_accum that the launches encode a TMA descriptor from, with the caller's strides:
// (rows, head dim, heads, batch entries), or kTransposed (head dim, rows, heads, batch entries) for the forward's V.
// A padded batch: rows = seqlen, its batch entries. Packed sequences: rows = max_seqlen and total + 1 entries one row
// apart, from a base max_seqlen rows before the tensor, so that row r of the sequence of tokens [start, start + len)
// is at (r + max_seqlen - len, start + len) (seq_rows below) and TMA's row bound is that sequence's end.
template <int kHeadDim, bool kTransposed = false, class T>
auto tma_rows_view(T* ptr, Strides const& st, int seqlen, int heads, int batch, int total, bool packed) {
  using namespace cute;
  T* base = ptr - (packed ? int64_t(seqlen) * st.row : 0);
  const int32_t entries = packed ? total + 1 : batch;
  const int64_t entry_stride = packed ? st.row : st.batch;
  if constexpr (kTransposed) {
    return make_tensor(make_gmem_ptr(base), make_shape(int32_t(kHeadDim), seqlen, heads, entries),
                       make_stride(_1{}, st.row, st.head, entry_stride));
  } else {
    return make_tensor(make_gmem_ptr(base), make_shape(seqlen, int32_t(kHeadDim), heads, entries),
                       make_stride(st.row, _1{}, st.head, entry_stride));
  }
}

struct SeqRows {
  int seqlen_q, seqlen_k;
  int q_shift, k_shift, q_coord, k_coord;
  int q_start;  // the sequence's first token in packed q, o and lse's rows; 0 for a padded batch
  int k_start;  // and in packed k and v (the backward's dK and dV rows)
};

// kPacks = false: a tile that never runs packed sequences (config.h: bwd_tile_packs) reads the uniform lengths, which
// then take no register.
template <bool kPacks = true, class Params>
__device__ __forceinline__ SeqRows seq_rows(Params const& p, int batch) {
  if (!kPacks || p.cu_seqlens_q == nullptr) return {p.seqlen_q, p.seqlen_k, 0, 0, batch, batch, 0, 0};
  const PackedSpan q = packed_span(p.cu_seqlens_q, batch, p.total_q, p.seqlen_q);
  const PackedSpan k = packed_span(p.cu_seqlens_k, batch, p.total_k, p.seqlen_k);
  return {q.len, k.len, p.seqlen_q - q.len, p.seqlen_k - k.len, q.start + q.len, k.start + k.len, q.start, k.start};
}

// The backward's row 0 of (a tile's sequence, head) in lse, d_sum and dq_accum: (batch, nheads, seqlen_q) rows, or
// packed (nheads, total_q) (common/seqlen.h: SeqInfo::stats_row); p.stats_head_rows apart from head to head.
template <bool kPacks, class Params>
__device__ __forceinline__ int stats_row(Params const& p, SeqRows const& seq, int batch, int head) {
  return (kPacks && p.cu_seqlens_q ? seq.q_start : batch * p.nheads * p.seqlen_q) + head * p.stats_head_rows;
}

}  // namespace fa2::sm90
