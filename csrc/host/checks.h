// The ops' argument checks: each says what is wrong with which argument and how to fix it, before anything is
// allocated or launched. std::invalid_argument reaches Python as ValueError, std::runtime_error as RuntimeError;
// Python has no exception for TypeError to come from, so those messages start with "TypeError: " and fa2's Python
// layer re-raises them as TypeError.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/stable/tensor.h>

#include "host/errors.h"

namespace fa2::host {

using torch::stable::Tensor;
using Ints = torch::headeronly::IntHeaderOnlyArrayRef;

std::string str(Ints a);  // as Python prints a tuple
std::string str(double x);  // as Python's repr
std::string device_str(const Tensor& t);
int32_t device_type(const Tensor& t);

// The kernels move 16-byte chunks: last dim contiguous, every row 16-byte aligned.
bool loadable(const Tensor& t);
void check_loadable(const char* name, const Tensor& t, const char* fix_like = nullptr);
// An output buffer (out, dq, dk, dv): like `like` in dtype and shape, and loadable.
void check_buffer(const char* name, const std::optional<Tensor>& t, const Tensor& like, const char* like_name);

// q, k, v and the scale, before any device check (so CPU tensors reach every message). Padded batches are
// (batch, seqlen, nheads, head_dim); packed ones (varlen) (total_tokens, nheads, head_dim).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, std::optional<double> softmax_scale, bool varlen);

// The options beyond plain attention (flash-attn's semantics, fa2.reference): the band of visible keys, softcap,
// ALiBi slopes, dropout and (forward only) the per-head sink logits.
struct Features {
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  const Tensor* alibi_slopes = nullptr;
  double dropout_p = 0.0;
  const Tensor* rng_state = nullptr;
  const Tensor* sink = nullptr;
};
// batch: the number of sequences (padded batch size, or cu_seqlens' length - 1).
void check_features(const Features& f, bool causal, const Tensor& q, int64_t batch);

// What the backward takes beyond q, k, v (padded and varlen alike): dout, the forward's out and lse, buffers.
void check_bwd_tensors(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                       const Tensor& lse, const std::optional<Tensor>& dq, const std::optional<Tensor>& dk,
                       const std::optional<Tensor>& dv, std::vector<int64_t> lse_shape, const char* fwd_name);

// cu_seqlens: types and shapes always; the values of CPU tensors, and of GPU tensors where `read_device` (a copy
// and a wait; not while a CUDA graph is captured).
void check_cu_seqlens(const Tensor& q, const Tensor& k, const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                      int64_t max_k, bool read_device);

// fa2.attention_with_kvcache's checks, after which nothing can fail but a launch.
void check_kvcache(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const std::optional<Tensor>& k_new,
                   const std::optional<Tensor>& v_new, const std::optional<Tensor>& cache_seqlens, int64_t cache_seqlen,
                   const std::optional<Tensor>& cache_batch_idx, const std::optional<Tensor>& block_table,
                   std::optional<double> softmax_scale);

// Its rotary embedding (rotary_cos, rotary_sin) and left padding (cache_leftpad), after check_kvcache.
void check_rotary_and_leftpad(const Tensor& q, const Tensor& k_cache, const std::optional<Tensor>& k_new,
                              const std::optional<Tensor>& block_table, const std::optional<Tensor>& rotary_cos,
                              const std::optional<Tensor>& rotary_sin, const std::optional<Tensor>& cache_leftpad);

// After the shape checks: every tensor on q's (the first's) CUDA device. Null entries are skipped.
void check_devices(std::initializer_list<std::pair<const char*, const Tensor*>> tensors);

}  // namespace fa2::host
