// Plain parameter structs handed from the bindings to the kernels: pointers, 64-bit element strides,
// sizes and flags. No torch, no CuTe: this header is the whole contract between host and device code.
#pragma once
#include <cstdint>

namespace fa2 {

// Layout of q/k/v/o (and their gradients): (batch, seqlen, nheads, head_dim), last dim contiguous,
// every other stride arbitrary (slices of a packed qkv tensor are fine). Strides count elements.
struct Strides {
  int64_t batch = 0, row = 0, head = 0;
};

// A KV cache (fa2.attention_with_kvcache): per sequence, how many of its cache rows hold keys, and where its rows live.
// Sequence b's cache rows are those of batch entry batch_index[b] of the cache tensors, or, paged, row r of it is row
// r % page_size of page block_table[b][r / page_size] (the tensors' dim 0 then counts pages). The kernels clamp every
// value read here to the tensors' bounds: bad values give wrong numbers, never out-of-bounds accesses.
struct KvCache {
  const int* seqlens = nullptr;  // (batch,) rows held before this call; nullptr: `seqlen` rows for every sequence
  int seqlen = 0;
  int appended = 0;              // rows this call appends after them (the new keys' seqlen)
  int capacity = 0;              // rows a sequence's cache can hold
  const int* batch_index = nullptr;  // (batch,) cache entry of each sequence; nullptr: entry b
  int cache_batch = 0;               // the cache tensors' dim 0: entries, or pages when paged
  const int* block_table = nullptr;  // (batch, block_table_stride) page ids; nullptr: not paged
  int block_table_stride = 0, page_size = 0;
  // (batch,) the first row of each sequence's cache (flash-attn's cache_leftpad; unpaged caches only): its keys are
  // rows [leftpad[b], seqlens[b] + appended), seqlens[b] counting the pad rows too; nullptr: 0.
  const int* leftpad = nullptr;
};

constexpr int kMaxSplits = 128;  // split-KV's most splits (FwdParams::num_splits): fwd_combine.h's shared memory

struct FwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // (batch, nheads, seqlen_q) contiguous (varlen: (nheads, total_q)); natural log
  Strides q_stride, k_stride, v_stride, o_stride;

  int batch = 0, seqlen_q = 0, seqlen_k = 0;
  int nheads = 0, nheads_k = 0;  // nheads % nheads_k == 0 (GQA/MQA)
  int head_dim = 0;              // actual head dim; the kernel is instantiated for a rounded-up size

  float softmax_scale = 0.f;  // scales q k^T, and dQ / dK in the backward
  // The kernels' scores are q k^T, or with softcap tanh(q k^T * softcap_in); the softmax scales them by
  // score_scale (softmax_scale, or softcap): base 2 with scale_log2 = score_scale * log2(e) (exp2 is one MUFU op).
  float score_scale = 0.f;
  float scale_log2 = 0.f;
  float softcap_in = 0.f;  // > 0: softcap on, = softmax_scale / softcap
  // Query i sees key j iff i + diagonal - window_left <= j <= i + diagonal + window_right, diagonal =
  // seqlen_k - seqlen_q (bottom-right aligned); -1 leaves that side unbounded. Causal is window_right = 0, and only
  // that: causal() reads it.
  int window_left = -1, window_right = -1;
  constexpr bool causal() const { return window_right == 0; }
  const float* sink = nullptr;  // (nheads,) fp32 logits that join each row's softmax denominator; nullptr: none
  // ALiBi: -slope * |i + diagonal - j| is added to the scaled score. fp32 slopes, (batch, nheads) with
  // alibi_batch_stride = nheads, or (nheads,) with stride 0; nullptr: none.
  const float* alibi_slopes = nullptr;
  int alibi_batch_stride = 0;
  // Dropout (dropout.h): rng_state = (seed, offset), int64 on the device (drawn by torch's generator per call, so
  // CUDA-graph replays draw anew); nullptr: none. A score is kept iff its draw is below dropout_threshold, and kept
  // probabilities are scaled by dropout_scale = 1 / (1 - dropout_p).
  const int64_t* rng_state = nullptr;
  uint32_t dropout_threshold = 0;
  float dropout_scale = 1.f;
  int head_group = 0;      // causal grids: heads whose blocks are dispatched heaviest first together (schedule.h);
                           // 0: the plain order. The launch plan sets it (host/plan.cpp; a test may force it)
  int smem_limit = 0;      // shared memory a block may use, bytes; 0 = the device's opt-in maximum. A test
                           // lowers it to run another GPU's configurations (config.h) on this one

  // Split-KV (config.h: fwd_num_splits): with num_splits > 1, CTA blockIdx.z = split * batch + batch entry, and split s
  // takes its share of every query block's key blocks (mask.h: split_share). It writes its rows' O, normalised over
  // its own keys, and their lse (without the sink) to the partials, whose rows are lse's rows (lse_rows of them) once
  // per split; fwd_combine.h merges them into o and lse.
  int num_splits = 1;  // at most kMaxSplits
  int64_t lse_rows = 0;
  float* o_partial = nullptr;    // (num_splits, lse_rows, head_dim) fp32
  float* lse_partial = nullptr;  // (num_splits, lse_rows) fp32

  // The Hopper family's tile counter (sm90/tile_scheduler.h, sm90/bwd_kernel.h): one int32, zeroed by the forward's
  // launch and by the backward's preprocess.
  int* tile_counter = nullptr;

  // Packed variable-length batches (both nullptr for padded ones): sequence b owns tokens
  // [cu_seqlens_q[b], cu_seqlens_q[b+1]) of (total_q, nheads, head_dim) q/o and likewise of k/v. Then the
  // strides' batch field is 0, seqlen_q/seqlen_k are the longest lengths (they size the grid), causal is
  // per sequence, and lse (and the backward's d_sum, dq_accum) rows are laid out (nheads, total_q).
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int total_q = 0, total_k = 0;

  // A KV cache (padded batches only; k/v and their strides are the cache tensors'). With cache.seqlens, sequence b
  // sees the first min(cache.seqlens[b] + cache.appended, seqlen_k) rows of its cache, seqlen_k being the capacity;
  // without, seqlen_k rows.
  KvCache cache;
};

// Appending a step's new keys and values to a KV cache (kv_append.h): row s of sequence b's k_new/v_new goes to cache
// row cache.seqlens[b] + s, skipped where that is past the capacity. With a rotary embedding the new keys are rotated
// on the way, and q is rotated into q_rotated, which the attention then reads.
struct KvAppendParams {
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  Strides k_new_stride, v_new_stride;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  Strides k_cache_stride, v_cache_stride;
  int batch = 0, nheads_k = 0;
  int seqlen_new = 0;  // the grid's rows: the new keys' (cache.appended), or q's where q is rotated and has more
  int row_bytes = 0;   // head_dim * element size, a multiple of 16
  KvCache cache;

  // Rotary embedding (flash-attn's rotary_cos/rotary_sin), applied when rotary_dim > 0 to the first rotary_dim
  // elements of each head of k_new (at its cache row's position, cache.seqlens[b] + s) and of q, whose row i is at
  // position cache.seqlens[b] + i when q_per_row (causal or windowed calls), else cache.seqlens[b] for every row.
  // Pairs are (j, j + rotary_dim / 2), or with interleaved (2j, 2j + 1); each turns by the angle whose cosine and sine
  // are row `position` (clamped to [0, seqlen_ro)), column j of cos and sin ((seqlen_ro, rotary_dim / 2), q's dtype,
  // contiguous). Computed in fp32 and rounded once.
  int rotary_dim = 0;
  bool interleaved = false, q_per_row = false, bf16 = false;
  int seqlen_ro = 0;
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  const void* q = nullptr;    // (batch, seqlen_q, nheads, head_dim)
  void* q_rotated = nullptr;  // like q, written whole
  Strides q_stride, q_rotated_stride;
  int seqlen_q = 0, nheads = 0;
};

struct BwdParams : FwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;  // (batch, seqlen_k, slices, head_dim): one slice per query head (mma.sync) or per walk of a
  void* dv = nullptr;  // K/V group's heads (Hopper: BwdPlan::walk_heads); ops.cpp sums a group's slices
  bool dkv_fp32 = false;  // dk/dv are float32 (GQA/MQA: the group is summed before rounding once)
  float* dq_accum = nullptr;  // (lse's rows, head_dim) fp32 workspace, zeroed by the kernels
  float* d_sum = nullptr;     // D = rowsum(dO * O), laid out like lse; fp32 workspace
  Strides dout_stride, dq_stride, dk_stride, dv_stride;
  bool deterministic = false;
  // Deterministic Hopper backward: per (query block, batch, head), how many key blocks have added their dQ share, then
  // one counter of the CTAs' tickets (int32, zeroed by the launch); null otherwise.
  int* dq_semaphore = nullptr;
  // Persistent Hopper backward: per (query block of plan.shape.block_m rows, batch, head), how many key blocks' dQ
  // shares are complete in dq_accum, which lets the kernel convert dQ itself (sm90/bwd_dq_convert.h; int32, zeroed by
  // the launch); null otherwise.
  int* dq_done = nullptr;
};

}  // namespace fa2
