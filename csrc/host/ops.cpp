// fa2's CUDA ops, registered through the LibTorch Stable ABI: each checks its arguments (checks.h), allocates through
// torch's caching allocator, fills the kernels' parameters, has the launch planned (plan.h) and launched (dispatch.h)
// on the current stream. Schemas, fake implementations and autograd live in python/fa2/ops.py; this file only
// implements the kernels behind them, so one build serves every torch from TORCH_TARGET_VERSION on.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "common/params.h"
#include "host/checks.h"
#include "host/dispatch.h"
#include "host/plan.h"
#include "host/state.h"
#include "sm90/config.h"

namespace fa2::host {
namespace {

using torch::headeronly::ScalarType;

DType to_dtype(ScalarType t) { return t == ScalarType::Half ? DType::fp16 : DType::bf16; }
const Tensor* opt(const std::optional<Tensor>& t) { return t ? &*t : nullptr; }

// ------------------------------------------------------------------------------------------- allocation
// Contiguous, on `like`'s device, through torch's caching allocator (capture-safe).
Tensor new_tensor(const Tensor& like, std::initializer_list<int64_t> sizes, std::optional<ScalarType> dtype = {}) {
  int64_t strides[8];
  const int64_t ndim = int64_t(sizes.size());
  int64_t stride = 1;
  for (int64_t i = ndim - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= std::max<int64_t>(sizes.begin()[i], 1);
  }
  AtenTensorHandle handle = nullptr;
  const AOTITorchError err = aoti_torch_empty_strided(
      ndim, sizes.begin(), strides, static_cast<int32_t>(dtype.value_or(like.scalar_type())), device_type(like),
      like.get_device_index(), &handle);
  if (err != AOTI_TORCH_SUCCESS) throw std::runtime_error("fa2: allocating a tensor failed (out of memory?)");
  return Tensor(handle);
}

Tensor new_like(const Tensor& t) {
  switch (t.dim()) {
    case 3: return new_tensor(t, {t.size(0), t.size(1), t.size(2)});
    default: return new_tensor(t, {t.size(0), t.size(1), t.size(2), t.size(3)});
  }
}

// ------------------------------------------------------------------------------------------- parameters
Strides strides_of(const Tensor& t) {  // (batch, row, head); packed tensors have no batch stride
  if (t.dim() == 3) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

struct Sizes {  // what the kernels need beyond pointers and strides
  int batch, seqlen_q, seqlen_k, total_q = 0, total_k = 0;
};

Sizes padded_sizes(const Tensor& q, const Tensor& k) { return {int(q.size(0)), int(q.size(1)), int(k.size(1))}; }

Sizes varlen_sizes(const Tensor& q, const Tensor& k, const Tensor& cu_q, int64_t max_q, int64_t max_k) {
  return {int(cu_q.numel() - 1), int(max_q), int(max_k), int(q.size(0)), int(k.size(0))};
}

void fill_common(FwdParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                 const Sizes& s, std::optional<double> softmax_scale, bool causal, const Features& f,
                 const Tensor* cu_q, const Tensor* cu_k) {
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.o = out.data_ptr();
  p.lse = static_cast<float*>(lse.data_ptr());
  p.q_stride = strides_of(q), p.k_stride = strides_of(k), p.v_stride = strides_of(v), p.o_stride = strides_of(out);
  p.batch = s.batch, p.seqlen_q = s.seqlen_q, p.seqlen_k = s.seqlen_k;
  p.nheads = int(q.size(-2)), p.nheads_k = int(k.size(-2)), p.head_dim = int(q.size(-1));
  const double scale = softmax_scale.value_or(1.0 / std::sqrt(double(p.head_dim)));
  p.softmax_scale = float(scale);
  // Softcap: the kernels' scores are tanh(q k^T * scale / softcap), which the softmax scales by softcap.
  const double score_scale = f.softcap > 0.0 ? f.softcap : scale;
  p.score_scale = float(score_scale);
  p.scale_log2 = float(score_scale * M_LOG2E);
  p.softcap_in = f.softcap > 0.0 ? float(scale / f.softcap) : 0.f;
  // A bound at least as wide as the sequences is no bound: -1 skips its block arithmetic and masks.
  auto bound = [&](int64_t w) { return w < 0 || w >= int64_t(s.seqlen_q) + s.seqlen_k ? -1 : int(w); };
  p.window_left = bound(f.window_left);
  p.window_right = causal ? 0 : bound(f.window_right);
  p.sink = f.sink ? static_cast<const float*>(f.sink->data_ptr()) : nullptr;
  p.alibi_slopes = f.alibi_slopes ? static_cast<const float*>(f.alibi_slopes->data_ptr()) : nullptr;
  p.alibi_batch_stride = f.alibi_slopes && f.alibi_slopes->dim() == 2 ? p.nheads : 0;
  // fa2.reference.dropout_keep_mask: kept iff 16 drawn bits < floor((1 - p) * 2^16). A p too small to move that
  // threshold off 2^16 (p <= 2^-54, where 1 - p rounds to 1) keeps every score at scale 1: no dropout, exactly; the
  // kernels compare against threshold << 16, which needs it below 2^16.
  const double keep_threshold = std::floor((1.0 - f.dropout_p) * 65536.0);
  if (f.dropout_p > 0.0 && keep_threshold < 65536.0) {
    p.rng_state = static_cast<const int64_t*>(f.rng_state->data_ptr());
    p.dropout_threshold = uint32_t(keep_threshold);
    p.dropout_scale = float(1.0 / (1.0 - f.dropout_p));
  }
  p.cu_seqlens_q = cu_q ? static_cast<const int*>(cu_q->data_ptr()) : nullptr;
  p.cu_seqlens_k = cu_k ? static_cast<const int*>(cu_k->data_ptr()) : nullptr;
  p.total_q = s.total_q, p.total_k = s.total_k;
  p.smem_limit = g_overrides.smem_limit.load(std::memory_order_relaxed);
  const int group = g_overrides.head_group.load(std::memory_order_relaxed);  // the plan applies it
  if (group != 0 && p.nheads % group != 0) {
    value_error("the test override head_group=" + std::to_string(group) + " must divide nheads=" +
                std::to_string(p.nheads));
  }
}

// The launch of a forward whose parameters are filled: its plan (GQA decode packing, the tile, split-KV's count:
// `forced_splits` if > 0, where the instance can split) and split-KV's workspaces. kernel_dim: pick_head_dim's.
void launch_forward(FwdParams& p, const Tensor& q, const Tensor& lse, DType dtype, int kernel_dim, int forced_splits) {
  const FwdPlan plan = plan_forward(p, dtype, kernel_dim, forced_splits, device_info(p));
  std::optional<Tensor> o_partial, lse_partial;  // split-KV's workspaces, alive until the launches are queued
  std::optional<Tensor> tile_counter;            // the Hopper forward's (sm90/tile_scheduler.h)
  if (plan.family == Family::kSm90) {
    tile_counter = new_tensor(q, {p.cu_seqlens_q ? 2 + p.batch : 1}, ScalarType::Int);
    p.tile_counter = static_cast<int*>(tile_counter->data_ptr());
  }
  if (p.num_splits > 1) {
    p.lse_rows = lse.numel();
    lse_partial = new_tensor(q, {p.num_splits, p.lse_rows}, ScalarType::Float);
    o_partial = new_tensor(q, {p.num_splits, p.lse_rows, p.head_dim}, ScalarType::Float);
    p.lse_partial = static_cast<float*>(lse_partial->data_ptr());
    p.o_partial = static_cast<float*>(o_partial->data_ptr());
  }
  launch_fwd(p, plan, q.get_device_index());
}

// Padded when cu_q is null. Writes into `out` when given. Returns (out, lse).
std::tuple<Tensor, Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* cu_q,
                                   const Tensor* cu_k, int64_t max_q, int64_t max_k, std::optional<double> softmax_scale,
                                   bool causal, const Features& f, std::optional<Tensor> out_buffer) {
  const bool varlen = cu_q != nullptr;
  check_qkv(q, k, v, softmax_scale, varlen);
  check_buffer("out", out_buffer, q, "q");
  if (varlen) check_cu_seqlens(q, k, *cu_q, *cu_k, max_q, max_k, /*read_device=*/false);
  check_features(f, causal, q, varlen ? cu_q->numel() - 1 : q.size(0));
  if (!recording()) {
    check_devices({{"q", &q}, {"k", &k}, {"v", &v}, {"out", out_buffer ? &*out_buffer : nullptr},
                   {"cu_seqlens_q", cu_q}, {"cu_seqlens_k", cu_k}, {"sink", f.sink},
                   {"alibi_slopes", f.alibi_slopes}, {"rng_state", f.dropout_p > 0.0 ? f.rng_state : nullptr}});
  }
  const DType dtype = to_dtype(q.scalar_type());
  const int kernel_dim = pick_head_dim(int(q.size(-1)), dtype, "fwd");  // its error before any allocation
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  if (q.is_cuda()) guard.emplace(q.get_device_index());
  Tensor out = out_buffer ? *out_buffer : new_like(q);
  Tensor lse = varlen ? new_tensor(q, {q.size(1), q.size(0)}, ScalarType::Float)
                      : new_tensor(q, {q.size(0), q.size(2), q.size(1)}, ScalarType::Float);
  const Sizes s = varlen ? varlen_sizes(q, k, *cu_q, max_q, max_k) : padded_sizes(q, k);
  if (q.numel() == 0 || s.seqlen_q == 0) return {out, lse};
  if ((k.numel() == 0 || s.seqlen_k == 0) && f.sink == nullptr) {  // no keys: every row is empty
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -INFINITY);
    return {out, lse};
  }
  FwdParams p;
  fill_common(p, q, k, v, out, lse, s, softmax_scale, causal, f, cu_q, cu_k);
  launch_forward(p, q, lse, dtype, kernel_dim, 0);
  return {out, lse};
}

std::tuple<Tensor, Tensor> fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, std::optional<Tensor> k_new,
                                       std::optional<Tensor> v_new, std::optional<Tensor> cache_seqlens,
                                       int64_t cache_seqlen, std::optional<Tensor> cache_batch_idx,
                                       std::optional<Tensor> block_table, std::optional<double> softmax_scale,
                                       bool causal, int64_t window_left, int64_t window_right, double softcap,
                                       std::optional<Tensor> alibi_slopes, std::optional<Tensor> sink,
                                       int64_t num_splits, std::optional<Tensor> rotary_cos,
                                       std::optional<Tensor> rotary_sin, bool rotary_interleaved,
                                       std::optional<Tensor> cache_leftpad) {
  check_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_seqlen, cache_batch_idx, block_table,
                softmax_scale);
  check_rotary_and_leftpad(q, k_cache, k_new, block_table, rotary_cos, rotary_sin, cache_leftpad);
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), 0.0, nullptr, opt(sink)};
  check_features(f, causal, q, q.size(0));
  if (num_splits < 0 || num_splits > kMaxSplits) {
    value_error("num_splits must be 0 (chosen by fa2) or a split count in [1, " + std::to_string(kMaxSplits) +
                "], got " + std::to_string(num_splits));
  }
  if (!recording()) {
    check_devices({{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"k", opt(k_new)}, {"v", opt(v_new)},
                   {"cache_seqlens", opt(cache_seqlens)}, {"cache_batch_idx", opt(cache_batch_idx)},
                   {"block_table", opt(block_table)}, {"sink", f.sink}, {"alibi_slopes", f.alibi_slopes},
                   {"rotary_cos", opt(rotary_cos)}, {"rotary_sin", opt(rotary_sin)},
                   {"cache_leftpad", opt(cache_leftpad)}});
  }
  const DType dtype = to_dtype(q.scalar_type());
  int kernel_dim = pick_head_dim(int(q.size(-1)), dtype, "fwd");
  if (block_table && !reads_pages(kernel_dim)) {  // a wider kernel that reads pages, its extra columns masked
    kernel_dim = pick_paged_head_dim(kernel_dim, dtype);
    if (kernel_dim == 0) {
      value_error("a paged KV cache (block_table) at head_dim " + std::to_string(q.size(-1)) + " runs on a forward "
                  "kernel that reads pages (head dim 64, 128 or 160-256) at or above it, and this build has none: "
                  "rebuild with FA2_HEAD_DIMS including one, or use a cache with one entry per sequence "
                  "(cache_batch_idx picks them)");
    }
  }
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  if (q.is_cuda()) guard.emplace(q.get_device_index());
  Tensor out = new_like(q);
  Tensor lse = new_tensor(q, {q.size(0), q.size(2), q.size(1)}, ScalarType::Float);

  KvCache cache;
  cache.seqlens = cache_seqlens ? static_cast<const int*>(cache_seqlens->data_ptr()) : nullptr;
  cache.appended = k_new ? int(k_new->size(1)) : 0;
  cache.capacity = int(block_table ? block_table->size(1) * k_cache.size(1) : k_cache.size(1));
  cache.seqlen = cache.seqlens ? 0 : cache_seqlen < 0 ? cache.capacity - cache.appended : int(cache_seqlen);
  cache.batch_index = cache_batch_idx ? static_cast<const int*>(cache_batch_idx->data_ptr()) : nullptr;
  cache.cache_batch = int(k_cache.size(0));
  if (block_table) {
    cache.block_table = static_cast<const int*>(block_table->data_ptr());
    cache.block_table_stride = int(block_table->size(1));
    cache.page_size = int(k_cache.size(1));
  }
  cache.leftpad = cache_leftpad ? static_cast<const int*>(cache_leftpad->data_ptr()) : nullptr;
  // With a rotary embedding the append's grid also rotates q into q_rotated, which the attention reads instead of q.
  // q_rotated is `out` (one allocation less on a decode step's host path): each CTA of the forward reads its Q tile
  // once, first, and writes the same rows and heads of O last, and a split forward's combine writes O only after
  // every split has read its Q (pdl.h's wait).
  const bool rotary = rotary_cos.has_value(), rotate_q = rotary && q.numel() > 0;
  Tensor q_attended = rotate_q ? out : q;
  if (k_new && (k_new->numel() > 0 || rotary)) {
    KvAppendParams a;
    a.k_new = k_new->data_ptr(), a.v_new = v_new->data_ptr();
    a.k_new_stride = strides_of(*k_new), a.v_new_stride = strides_of(*v_new);
    a.k_cache = k_cache.data_ptr(), a.v_cache = v_cache.data_ptr();
    a.k_cache_stride = strides_of(k_cache), a.v_cache_stride = strides_of(v_cache);
    a.batch = int(q.size(0)), a.seqlen_new = int(k_new->size(1)), a.nheads_k = int(k_cache.size(2));
    a.row_bytes = int(k_cache.size(3)) * 2;
    a.cache = cache;
    if (rotary) {
      a.rotary_dim = int(rotary_cos->size(1)) * 2, a.seqlen_ro = int(rotary_cos->size(0));
      a.interleaved = rotary_interleaved, a.bf16 = dtype == DType::bf16;
      // flash-attn's rule: q's rows advance in position only where the mask depends on it (causal or a window).
      const int64_t capacity = cache.capacity;
      a.q_per_row = causal || (window_left >= 0 && window_left < capacity) ||
                    (window_right >= 0 && window_right < capacity);
      a.rotary_cos = rotary_cos->data_ptr(), a.rotary_sin = rotary_sin->data_ptr();
      a.q = q.data_ptr(), a.q_rotated = q_attended.data_ptr();
      a.q_stride = strides_of(q), a.q_rotated_stride = strides_of(q_attended);
      a.seqlen_q = rotate_q ? int(q.size(1)) : 0, a.nheads = int(q.size(2));
      a.seqlen_new = std::max(a.seqlen_new, a.seqlen_q);
    }
    launch_kv_append(a, q.get_device_index());
  }
  // Without cache_seqlens every sequence sees the same rows: seqlen_k is that count, as for a plain forward.
  const int seqlen_k = cache.seqlens ? cache.capacity : std::min(cache.seqlen + cache.appended, cache.capacity);
  const Sizes s{int(q.size(0)), int(q.size(1)), seqlen_k};
  if (q.numel() == 0 || s.seqlen_q == 0) return {out, lse};
  if (seqlen_k == 0 && f.sink == nullptr) {  // no keys: every row is empty
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -INFINITY);
    return {out, lse};
  }
  FwdParams p;
  fill_common(p, q_attended, k_cache, v_cache, out, lse, s, softmax_scale, causal, f, nullptr, nullptr);
  p.cache = cache;
  launch_forward(p, q, lse, dtype, kernel_dim, int(num_splits));
  return {out, lse};
}

// ------------------------------------------------------------------------------------------- the backward
std::tuple<Tensor, Tensor, Tensor> backward(const Tensor& dout_in, const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& out, const Tensor& lse, const Tensor* cu_q, const Tensor* cu_k,
                                            int64_t max_q, int64_t max_k, std::optional<double> softmax_scale,
                                            bool causal, const Features& f, bool deterministic,
                                            std::optional<Tensor> dq_buffer, std::optional<Tensor> dk_buffer,
                                            std::optional<Tensor> dv_buffer, std::optional<Tensor> d_sum_buffer) {
  const bool varlen = cu_q != nullptr;
  check_qkv(q, k, v, softmax_scale, varlen);
  if (varlen) {
    check_bwd_tensors(dout_in, q, k, v, out, lse, dq_buffer, dk_buffer, dv_buffer, {q.size(1), q.size(0)}, "fwd_varlen");
    check_cu_seqlens(q, k, *cu_q, *cu_k, max_q, max_k, /*read_device=*/false);
  } else {
    check_bwd_tensors(dout_in, q, k, v, out, lse, dq_buffer, dk_buffer, dv_buffer, {q.size(0), q.size(2), q.size(1)},
                      "fwd");
  }
  check_features(f, causal, q, varlen ? cu_q->numel() - 1 : q.size(0));
  if (d_sum_buffer && (d_sum_buffer->scalar_type() != ScalarType::Float ||
                       !d_sum_buffer->sizes().equals(lse.sizes()) || !d_sum_buffer->is_contiguous())) {
    value_error("d_sum must be a contiguous float32 tensor laid out like lse " + str(lse.sizes()) + ", got shape " +
                str(d_sum_buffer->sizes()));
  }
  if (!recording()) {
    check_devices({{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout_in}, {"lse", &lse},
                   {"d_sum", d_sum_buffer ? &*d_sum_buffer : nullptr},
                   {"dq", dq_buffer ? &*dq_buffer : nullptr}, {"dk", dk_buffer ? &*dk_buffer : nullptr},
                   {"dv", dv_buffer ? &*dv_buffer : nullptr}, {"cu_seqlens_q", cu_q}, {"cu_seqlens_k", cu_k},
                   {"alibi_slopes", f.alibi_slopes}, {"rng_state", f.dropout_p > 0.0 ? f.rng_state : nullptr}});
  }
  const DType dtype = to_dtype(q.scalar_type());
  const int kernel_dim = pick_head_dim(int(q.size(-1)), dtype, "bwd");  // its error before any allocation
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  if (q.is_cuda()) guard.emplace(q.get_device_index());
  // Gradients often arrive transposed or broadcast: copied where the kernels could not load them.
  const Tensor dout = loadable(dout_in) ? dout_in : torch::stable::contiguous(dout_in);
  Tensor dq = dq_buffer ? *dq_buffer : new_like(q);
  Tensor dk = dk_buffer ? *dk_buffer : new_like(k);
  Tensor dv = dv_buffer ? *dv_buffer : new_like(v);
  const Sizes s = varlen ? varlen_sizes(q, k, *cu_q, max_q, max_k) : padded_sizes(q, k);
  if (q.numel() == 0 || k.numel() == 0 || s.seqlen_q == 0 || s.seqlen_k == 0) {
    torch::stable::zero_(dq), torch::stable::zero_(dk), torch::stable::zero_(dv);
    if (d_sum_buffer) torch::stable::zero_(*d_sum_buffer);  // no key: P = 0, so dP = 0 and O = 0
    return {dq, dk, dv};
  }
  const int64_t nheads = q.size(-2), nheads_k = k.size(-2), head_dim = q.size(-1);
  Tensor dq_accum = varlen ? new_tensor(q, {nheads, q.size(0), head_dim}, ScalarType::Float)
                           : new_tensor(q, {q.size(0), nheads, q.size(1), head_dim}, ScalarType::Float);
  Tensor d_sum = d_sum_buffer ? *d_sum_buffer
                 : varlen     ? new_tensor(lse, {lse.size(0), lse.size(1)})
                              : new_tensor(lse, {lse.size(0), lse.size(1), lse.size(2)});
  BwdParams p;
  fill_common(p, q, k, v, out, lse, s, softmax_scale, causal, f, cu_q, cu_k);
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dq_accum = static_cast<float*>(dq_accum.data_ptr()), p.d_sum = static_cast<float*>(d_sum.data_ptr());
  p.dout_stride = strides_of(dout), p.dq_stride = strides_of(dq);
  p.deterministic = deterministic;
  const BwdPlan plan = plan_backward(p, dtype, kernel_dim, device_info(p));
  // The kernels write dK and dV per walk (the Hopper backward's tiles walk plan.walk_heads query heads of a K/V group,
  // the mma.sync backward's one). Where a group has several walks (GQA/MQA), those slices are float32 and each group
  // is summed before the one rounding to the input dtype (rounding each slice first loses accuracy).
  const int64_t slices = nheads / plan.walk_heads;
  const bool grouped = slices != nheads_k;
  Tensor dk_heads = dk, dv_heads = dv;
  if (grouped) {
    dk_heads = varlen ? new_tensor(q, {k.size(0), slices, head_dim}, ScalarType::Float)
                      : new_tensor(q, {k.size(0), k.size(1), slices, head_dim}, ScalarType::Float);
    dv_heads = varlen ? new_tensor(q, {k.size(0), slices, head_dim}, ScalarType::Float)
                      : new_tensor(q, {k.size(0), k.size(1), slices, head_dim}, ScalarType::Float);
  }
  p.dk = dk_heads.data_ptr(), p.dv = dv_heads.data_ptr();
  p.dk_stride = strides_of(dk_heads), p.dv_stride = strides_of(dv_heads);
  p.dkv_fp32 = grouped;
  // The Hopper backward adds dQ from every key block into dq_accum; deterministic, it takes turns per query block.
  // Otherwise its persistent CTAs draw their tiles from a counter and count each query block's shares (dq_done).
  std::optional<Tensor> dq_semaphore, tile_counter;
  const int64_t m_blocks = (s.seqlen_q + plan.shape.block_m - 1) / plan.shape.block_m;
  if (!deterministic && plan.family == Family::kSm90 && sm90::bwd_persistent(plan.shape)) {
    // The counts a 128-byte line after the tile counter, so that the CTAs' draws and the counts' polls do not meet.
    tile_counter = new_tensor(q, {32 + int64_t(s.batch) * nheads * m_blocks}, ScalarType::Int);
    p.tile_counter = static_cast<int*>(tile_counter->data_ptr());
    p.dq_done = p.tile_counter + 32;
  }
  if (deterministic && plan.family == Family::kSm90) {
    dq_semaphore = new_tensor(q, {int64_t(s.batch) * nheads * m_blocks + 1}, ScalarType::Int);  // + the tickets
    p.dq_semaphore = static_cast<int*>(dq_semaphore->data_ptr());
  }
  launch_bwd(p, plan, q.get_device_index());
  if (grouped) {
    const int64_t group = slices / nheads_k;
    for (auto [grad, heads] : {std::pair<Tensor*, Tensor*>{&dk, &dk_heads}, {&dv, &dv_heads}}) {
      std::vector<int64_t> split(grad->sizes().begin(), grad->sizes().end() - 1);  // (..., nheads_k)
      split.push_back(group);
      split.push_back(head_dim);
      const int64_t group_dim = int64_t(split.size()) - 2;
      torch::stable::copy_(*grad, torch::stable::sum(torch::stable::view(*heads, Ints(split)), Ints(&group_dim, 1)));
    }
  }
  return {dq, dk, dv};
}

// ------------------------------------------------------------------------------------------- the ops
// Argument order and defaults: the schemas in python/fa2/ops.py.

std::tuple<Tensor, Tensor> fwd(Tensor q, Tensor k, Tensor v, std::optional<double> softmax_scale, bool causal,
                               bool /*deterministic: the backward's, saved by autograd*/, int64_t window_left,
                               int64_t window_right, double softcap, std::optional<Tensor> alibi_slopes,
                               double dropout_p, std::optional<Tensor> rng_state, std::optional<Tensor> sink) {
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), dropout_p, opt(rng_state), opt(sink)};
  return forward(q, k, v, nullptr, nullptr, 0, 0, softmax_scale, causal, f, std::nullopt);
}

std::tuple<Tensor, Tensor> fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
                                      int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<double> softmax_scale,
                                      bool causal, bool /*deterministic*/, int64_t window_left, int64_t window_right,
                                      double softcap, std::optional<Tensor> alibi_slopes, double dropout_p,
                                      std::optional<Tensor> rng_state, std::optional<Tensor> sink) {
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), dropout_p, opt(rng_state), opt(sink)};
  return forward(q, k, v, &cu_seqlens_q, &cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, f,
                 std::nullopt);
}

// The backward needs no sink: the forward's lse includes it, so the recomputed P is right. Its gradient is computed
// in Python from lse and D = rowsum(dO * O) (ops.sink_grad), which the backward's preprocess writes into `d_sum`
// (laid out like lse) where the caller passes it. ALiBi slopes get no gradient, as in flash-attn.
std::tuple<Tensor, Tensor, Tensor> bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                                       std::optional<double> softmax_scale, bool causal, bool deterministic,
                                       int64_t window_left, int64_t window_right, double softcap,
                                       std::optional<Tensor> alibi_slopes, double dropout_p,
                                       std::optional<Tensor> rng_state, std::optional<Tensor> d_sum) {
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), dropout_p, opt(rng_state), nullptr};
  return backward(dout, q, k, v, out, lse, nullptr, nullptr, 0, 0, softmax_scale, causal, f, deterministic,
                  std::nullopt, std::nullopt, std::nullopt, d_sum);
}

std::tuple<Tensor, Tensor, Tensor> bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                                              Tensor cu_seqlens_q, Tensor cu_seqlens_k, int64_t max_seqlen_q,
                                              int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal,
                                              bool deterministic, int64_t window_left, int64_t window_right,
                                              double softcap, std::optional<Tensor> alibi_slopes, double dropout_p,
                                              std::optional<Tensor> rng_state, std::optional<Tensor> d_sum) {
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), dropout_p, opt(rng_state), nullptr};
  return backward(dout, q, k, v, out, lse, &cu_seqlens_q, &cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                  causal, f, deterministic, std::nullopt, std::nullopt, std::nullopt, d_sum);
}

// The public fwd/bwd with caller-provided outputs (out=, dq=, dk=, dv=), padded or packed.
Tensor fwd_out(Tensor q, Tensor k, Tensor v, std::optional<Tensor> cu_seqlens_q, std::optional<Tensor> cu_seqlens_k,
               int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal, Tensor out,
               int64_t window_left, int64_t window_right, double softcap, std::optional<Tensor> alibi_slopes,
               double dropout_p, std::optional<Tensor> rng_state, std::optional<Tensor> sink) {
  const Tensor* cu_q = cu_seqlens_q ? &*cu_seqlens_q : nullptr;
  const Tensor* cu_k = cu_seqlens_k ? &*cu_seqlens_k : nullptr;
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), dropout_p, opt(rng_state), opt(sink)};
  return std::get<1>(forward(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, f, out));
}

void bwd_out(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, std::optional<Tensor> cu_seqlens_q,
             std::optional<Tensor> cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
             std::optional<double> softmax_scale, bool causal, bool deterministic, Tensor dq, Tensor dk, Tensor dv,
             int64_t window_left, int64_t window_right, double softcap, std::optional<Tensor> alibi_slopes,
             double dropout_p, std::optional<Tensor> rng_state) {
  const Tensor* cu_q = cu_seqlens_q ? &*cu_seqlens_q : nullptr;
  const Tensor* cu_k = cu_seqlens_k ? &*cu_seqlens_k : nullptr;
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), dropout_p, opt(rng_state), nullptr};
  backward(dout, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, f, deterministic, dq,
           dk, dv, std::nullopt);
}

// fa2::check_varlen: cu_seqlens' checks with their values read from the GPU too (a copy and a wait), for the
// Python layer's once-per-tensor check (ops.check_cu_seqlens_values); the ops above never wait for them. q and k
// give the token counts only: their own checks are the ops' (the Python layer may still zero-pad them first).
void check_varlen(Tensor q, Tensor k, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int64_t max_seqlen_q,
                  int64_t max_seqlen_k) {
  check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, /*read_device=*/true);
}

}  // namespace
}  // namespace fa2::host

// One kernel for every device: the checks reject non-CUDA tensors with a clear message (and record mode runs CPU
// tensors through them). Fake implementations for torch.compile are registered in Python.
STABLE_TORCH_LIBRARY_IMPL(fa2, CompositeExplicitAutograd, m) {
  m.impl("fwd", TORCH_BOX(&fa2::host::fwd));
  m.impl("fwd_varlen", TORCH_BOX(&fa2::host::fwd_varlen));
  m.impl("bwd", TORCH_BOX(&fa2::host::bwd));
  m.impl("bwd_varlen", TORCH_BOX(&fa2::host::bwd_varlen));
  m.impl("fwd_out", TORCH_BOX(&fa2::host::fwd_out));
  m.impl("bwd_out", TORCH_BOX(&fa2::host::bwd_out));
  m.impl("fwd_kvcache", TORCH_BOX(&fa2::host::fwd_kvcache));
  m.impl("check_varlen", TORCH_BOX(&fa2::host::check_varlen));
}
