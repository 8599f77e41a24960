// The ops' argument checks (checks.h).
#include "host/checks.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/tensor.h>

#include "common/launch.h"
#include "host/dispatch.h"
#include "sm80/config.h"  // kPageRows: a paged cache's page size

namespace fa2::host {

using torch::headeronly::ScalarType;

// ------------------------------------------------------------------------------------------- messages
void value_error(const std::string& msg) { throw std::invalid_argument(msg); }
void type_error(const std::string& msg) { throw std::invalid_argument("TypeError: " + msg); }

std::string str(Ints a) {  // as Python prints a tuple
  std::string s = "(";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + (a.size() == 1 ? ",)" : ")");
}

std::string str(ScalarType t) {
  switch (t) {
    case ScalarType::Half: return "torch.float16";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Long: return "torch.int64";
    case ScalarType::Short: return "torch.int16";
    case ScalarType::Char: return "torch.int8";
    case ScalarType::Byte: return "torch.uint8";
    case ScalarType::Bool: return "torch.bool";
    default: return "dtype code " + std::to_string(static_cast<int>(t));
  }
}

std::string str(double x) {  // shortest round trip, as Python's repr
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[32];
  auto end = std::to_chars(buf, buf + sizeof(buf), x).ptr;
  std::string s(buf, end);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

int32_t device_type(const Tensor& t) {
  int32_t type = 0;
  aoti_torch_get_device_type(t.get(), &type);
  return type;
}

std::string device_str(const Tensor& t) {
  if (t.is_cuda()) return "cuda:" + std::to_string(t.get_device_index());
  if (t.is_cpu()) return "cpu";
  return device_type(t) == 9 ? "meta" : "device type " + std::to_string(device_type(t));  // 9: c10's Meta
}

// ------------------------------------------------------------------------------------------- checks
bool is_half(ScalarType t) { return t == ScalarType::Half || t == ScalarType::BFloat16; }

// The kernels move 16-byte chunks (cp.async): last dim contiguous, every row 16-byte aligned.
bool loadable(const Tensor& t) {
  if (t.stride(-1) != 1) return false;
  if (t.numel() == 0) return true;
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (t.size(i) > 1 && t.stride(i) % 8 != 0) return false;
  }
  return true;
}

// `fix` says what to do about a tensor that fails; the messages are built only then (these checks run every call).
void check_loadable(const char* name, const Tensor& t, const char* fix_like) {
  if (loadable(t)) return;
  const std::string fix = fix_like ? std::string("allocate it with torch.empty_like(") + fix_like + ")"
                                   : std::string("pass ") + name + ".contiguous()";
  if (t.stride(-1) != 1) {
    value_error(std::string(name) + " must have a contiguous last dimension (stride 1), got strides " + str(t.strides()) +
                ": " + fix);
  }
  value_error(std::string(name) + " must start on a 16-byte boundary with strides that are multiples of 8 elements, "
              "got strides " + str(t.strides()) + " (data_ptr % 16 = " +
              std::to_string(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16) + "): " + fix);
}

// t has this dtype and shape (`what` and `whose` say where that requirement comes from: "like q", "fwd's lse").
void check_like(const char* name, const Tensor& t, ScalarType dtype, Ints shape, const char* what, const char* whose) {
  if (t.scalar_type() == dtype && t.sizes().equals(shape)) return;
  const std::string why = std::string(what) + whose;
  if (t.scalar_type() != dtype) {
    type_error(std::string(name) + " must be a " + str(dtype) + " tensor (" + why + "), got " + str(t.scalar_type()));
  }
  value_error(std::string(name) + " must have shape " + str(shape) + " (" + why + "), got " + str(t.sizes()));
}

// An output buffer (out, dq, dk, dv): like `like` in dtype and shape, and loadable.
void check_buffer(const char* name, const std::optional<Tensor>& t, const Tensor& like, const char* like_name) {
  if (!t.has_value()) return;
  check_like(name, *t, like.scalar_type(), like.sizes(), "like ", like_name);
  check_loadable(name, *t, like_name);
}

// The pieces check_qkv and check_kvcache share; `kv` names where the keys come from ("k's and v's", "the cache's"),
// `tensors` the tensors whose last dim is head_dim and `fix` how to pad them.
void check_half(const char* name, const Tensor& t, const char* or_else) {
  if (!is_half(t.scalar_type())) {
    type_error(std::string(name) + " must be float16 or bfloat16, got " + str(t.scalar_type()) + ": cast it (e.g. " +
               name + ".to(torch.bfloat16))" + or_else);
  }
}

void check_group(int64_t nheads, int64_t nheads_k, const char* kv) {
  if (nheads_k == 0 || nheads % nheads_k != 0) {
    value_error("q's nheads (" + std::to_string(nheads) + ") must be a multiple of " + kv + " nheads_k (" +
                std::to_string(nheads_k) + ") (GQA/MQA: each K/V head serves nheads // nheads_k query heads)");
  }
}

void check_head_dim(int64_t head_dim, const char* tensors, const char* fix) {
  if (head_dim % 8 != 0 || head_dim < 8 || head_dim > 256) {
    value_error(std::string("head_dim (last dim of ") + tensors + ") must be a multiple of 8 in [8, 256], got " +
                std::to_string(head_dim) + ": " + fix);
  }
}

// The online softmax keeps the max of unscaled scores, which is only the max of scaled ones for scale > 0; the
// kernels scale in float with denormals flushed, where a smaller scale is 0 and masked scores NaN.
void check_scale(std::optional<double> softmax_scale) {
  if (softmax_scale.has_value() && !(std::isfinite(*softmax_scale) && *softmax_scale >= FLT_MIN)) {
    value_error("softmax_scale must be a positive finite number (at least 1.18e-38, float's smallest normal) or None "
                "(head_dim ** -0.5), got " + str(*softmax_scale));
  }
}

// q, k, v and the scale, before any device check (so CPU tensors reach every message). Padded batches are
// (batch, seqlen, nheads, head_dim); packed ones (varlen) (total_tokens, nheads, head_dim).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, std::optional<double> softmax_scale, bool varlen) {
  const std::pair<const char*, const Tensor*> qkv[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  for (auto [name, t] : qkv) check_half(name, *t, ", or call fa2.attention inside torch.autocast");
  if (q.scalar_type() != k.scalar_type() || q.scalar_type() != v.scalar_type()) {
    type_error("q, k and v must have one dtype, got q " + str(q.scalar_type()) + ", k " + str(k.scalar_type()) + ", v " +
               str(v.scalar_type()) + ": cast k and v to q's dtype");
  }
  for (auto [name, t] : qkv) {
    if (varlen && t->dim() != 3) {
      value_error(std::string(name) + " must be 3-D (total_tokens, nheads, head_dim): the sequences packed one after "
                  "another along dim 0, got shape " + str(t->sizes()));
    }
    if (!varlen && t->dim() != 4) {
      value_error(std::string(name) + " must be 4-D (batch, seqlen, nheads, head_dim), got shape " + str(t->sizes()) +
                  "; for a single sequence use " + name + ".unsqueeze(0)");
    }
  }
  const int64_t nheads = q.size(-2), head_dim = q.size(-1);
  if (varlen && k.size(-1) != head_dim) {
    value_error("k must be (total_k, nheads_k, head_dim=" + std::to_string(head_dim) + ") to match q of shape " +
                str(q.sizes()) + ", got " + str(k.sizes()));
  }
  if (!varlen && (k.size(0) != q.size(0) || k.size(3) != head_dim)) {
    value_error("k must be (batch=" + std::to_string(q.size(0)) + ", seqlen_k, nheads_k, head_dim=" +
                std::to_string(head_dim) + ") to match q of shape " + str(q.sizes()) + ", got " + str(k.sizes()));
  }
  if (!v.sizes().equals(k.sizes())) {
    value_error("v must have the same shape as k " + str(k.sizes()) + ", got " + str(v.sizes()));
  }
  check_group(nheads, k.size(-2), "k's and v's");
  check_head_dim(head_dim, "q, k, v", "zero-pad q, k and v to a multiple of 8 (and pass softmax_scale for the true "
                 "head_dim)");
  for (auto [name, t] : qkv) check_loadable(name, *t);
  check_scale(softmax_scale);
  const int64_t kIntMax = 2147483647;
  if (q.size(-3) > kIntMax || k.size(-3) > kIntMax || nheads > 65535) {
    value_error("q and k may have at most 2**31 - 1 tokens and 65535 heads, got q " + str(q.sizes()) + " and k " +
                str(k.sizes()));
  }
}


// batch: the number of sequences (padded batch size, or cu_seqlens' length - 1).
void check_features(const Features& f, bool causal, const Tensor& q, int64_t batch) {
  for (auto [name, w] : {std::pair<const char*, int64_t>{"window_size[0] (left)", f.window_left},
                         {"window_size[1] (right)", f.window_right}}) {
    if (w < -1 || w > 2147483647) {
      value_error(std::string(name) + " must be -1 (unbounded) or a number of keys in [0, 2**31 - 1], got " +
                  std::to_string(w));
    }
  }
  if (causal && f.window_right > 0) {
    value_error("causal=True sees no key right of the diagonal, but window_size[1] (right) = " +
                std::to_string(f.window_right) + ": pass causal=False with window_size=(left, right), or right = 0");
  }
  if (!(std::isfinite(f.softcap) && f.softcap >= 0.0)) {
    value_error("softcap must be 0 (off) or a positive finite number, got " + str(f.softcap));
  }
  if (f.alibi_slopes != nullptr) {
    const Tensor& a = *f.alibi_slopes;
    if (a.scalar_type() != ScalarType::Float) {
      type_error("alibi_slopes must be float32, got " + str(a.scalar_type()) + ": pass alibi_slopes.float()");
    }
    const int64_t nheads = q.size(-2);
    const bool per_head = a.dim() == 1 && a.size(0) == nheads;
    const bool per_batch = a.dim() == 2 && a.size(0) == batch && a.size(1) == nheads;
    if (!(per_head || per_batch) || !a.is_contiguous()) {
      value_error("alibi_slopes must be a contiguous (nheads=" + std::to_string(nheads) + ",) or (batch=" +
                  std::to_string(batch) + ", nheads=" + std::to_string(nheads) + ") tensor, got shape " +
                  str(a.sizes()) + " and strides " + str(a.strides()));
    }
  }
  if (!(f.dropout_p >= 0.0 && f.dropout_p < 1.0)) {
    value_error("dropout_p must be in [0, 1), got " + str(f.dropout_p));
  }
  if (f.dropout_p > 0.0) {
    if (f.rng_state == nullptr) {
      value_error("dropout_p=" + str(f.dropout_p) + " needs rng_state, the (seed, offset) the mask is drawn from: an "
                  "int64 tensor of shape (2,) on q's device (fa2.attention draws one from torch's generator)");
    }
    const Tensor& r = *f.rng_state;
    if (r.scalar_type() != ScalarType::Long || r.dim() != 1 || r.size(0) != 2 || !r.is_contiguous()) {
      value_error("rng_state must be a contiguous int64 tensor of shape (2,) (seed, offset), got " +
                  str(r.scalar_type()) + " of shape " + str(r.sizes()));
    }
  }
  if (f.sink == nullptr) return;
  const Tensor& sink = *f.sink;
  if (sink.scalar_type() != ScalarType::Float) {
    type_error("sink must be float32, got " + str(sink.scalar_type()) + ": pass sink.float()");
  }
  if (sink.dim() != 1 || sink.size(0) != q.size(-2) || !sink.is_contiguous()) {
    value_error("sink must be a contiguous (nheads=" + std::to_string(q.size(-2)) + ",) tensor, one logit per query "
                "head, got shape " + str(sink.sizes()) + " and strides " + str(sink.strides()));
  }
}

// What the backward takes beyond q, k, v (padded and varlen alike): dout, the forward's out and lse, buffers.
void check_bwd_tensors(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                       const Tensor& lse, const std::optional<Tensor>& dq, const std::optional<Tensor>& dk,
                       const std::optional<Tensor>& dv, std::vector<int64_t> lse_shape, const char* fwd_name) {
  check_like("dout", dout, q.scalar_type(), q.sizes(), "like ", "q");  // any strides: copied if needed
  check_buffer("out", out, q, "q");
  check_like("lse", lse, ScalarType::Float, Ints(lse_shape), fwd_name, "'s lse");
  if (!lse.is_contiguous()) value_error("lse must be contiguous, got strides " + str(lse.strides()) + ": pass lse.contiguous()");
  check_buffer("dq", dq, q, "q");
  check_buffer("dk", dk, k, "k");
  check_buffer("dv", dv, v, "v");
}

// cu_seqlens: types and shapes always; the values where reading them costs no wait (CPU tensors), and GPU tensors'
// values where `read_device` (fa2::check_varlen, which the Python layer calls once per pair of tensors; never while
// a CUDA graph is captured). A read from the GPU is a copy and a stream synchronize, which per call left the GPU
// idle for the host's launch path (docs/host-path.md#cu_seqlens-values). The kernels clamp whatever they read to the
// tensors' bounds, so unchecked bad values give wrong numbers, never out-of-bounds accesses.
void check_cu_seqlens(const Tensor& q, const Tensor& k, const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                      int64_t max_k, bool read_device) {
  const std::pair<const char*, const Tensor*> cus[] = {{"cu_seqlens_q", &cu_q}, {"cu_seqlens_k", &cu_k}};
  for (auto [name, cu] : cus) {
    if (cu->scalar_type() != ScalarType::Int) {
      type_error(std::string(name) + " must be an int32 tensor, got " + str(cu->scalar_type()) + ": pass " + name +
                 ".to(torch.int32)");
    }
    if (cu->dim() != 1 || cu->numel() < 2) {
      value_error(std::string(name) + " must be 1-D (batch + 1,) with batch >= 1: [0, len_0, len_0 + len_1, ...], got "
                  "shape " + str(cu->sizes()));
    }
    if (device_type(*cu) != device_type(q) || cu->get_device_index() != q.get_device_index()) {
      value_error(std::string(name) + " is on " + device_str(*cu) + " but q is on " + device_str(q) +
                  ": put it on q's device");
    }
  }
  if (cu_q.numel() != cu_k.numel()) {
    value_error("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got " +
                std::to_string(cu_q.numel() - 1) + " and " + std::to_string(cu_k.numel() - 1));
  }
  if (max_q < 0 || max_k < 0 || max_q > 2147483647 || max_k > 2147483647) {
    value_error("max_seqlen_q and max_seqlen_k must be in [0, 2**31 - 1], got " + std::to_string(max_q) + " and " +
                std::to_string(max_k));
  }
  if (cu_q.numel() - 1 > 65535) value_error("at most 65535 sequences per call, got " + std::to_string(cu_q.numel() - 1));
  // The values: one small copy to the host (and a wait) where the tensors are on the GPU.
  const int64_t n = cu_q.numel();
  std::vector<int> values(2 * n);
  if (cu_q.is_cuda()) {
    if (!read_device) return;
    torch::stable::accelerator::DeviceGuard guard(cu_q.get_device_index());
    const std::optional<cudaStream_t> stream = torch_stream(cu_q.get_device_index());
    if (!stream) return;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(*stream, &capturing) != cudaSuccess ||
        capturing != cudaStreamCaptureStatusNone) {
      cudaGetLastError();
      return;
    }
    const cudaStream_t s = *stream;
    check_cuda(cudaMemcpyAsync(values.data(), cu_q.data_ptr(), n * sizeof(int), cudaMemcpyDeviceToHost, s), "cu_seqlens_q");
    check_cuda(cudaMemcpyAsync(values.data() + n, cu_k.data_ptr(), n * sizeof(int), cudaMemcpyDeviceToHost, s), "cu_seqlens_k");
    check_cuda(cudaStreamSynchronize(s), "reading cu_seqlens");
  } else if (cu_q.is_cpu()) {
    for (int64_t i = 0; i < n; ++i) {
      values[i] = static_cast<const int*>(cu_q.data_ptr())[i * cu_q.stride(0)];
      values[n + i] = static_cast<const int*>(cu_k.data_ptr())[i * cu_k.stride(0)];
    }
  } else {
    return;  // meta tensors: no values
  }
  const struct { const char* name; const int* cu; int64_t total; const char* max_name; int64_t max_len; } rows[] = {
      {"cu_seqlens_q", values.data(), q.size(0), "max_seqlen_q", max_q},
      {"cu_seqlens_k", values.data() + n, k.size(0), "max_seqlen_k", max_k}};
  for (const auto& r : rows) {
    int64_t longest = 0;
    bool ok = r.cu[0] == 0;
    for (int64_t i = 1; i < n; ++i) {
      ok &= r.cu[i] >= r.cu[i - 1];
      longest = std::max<int64_t>(longest, int64_t(r.cu[i]) - r.cu[i - 1]);
    }
    if (!ok) {
      std::string list = "[";
      for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) list += (i ? ", " : "") + std::to_string(r.cu[i]);
      value_error(std::string(r.name) + " must start at 0 and never decrease, got " + list + "]" + (n > 16 ? " ..." : ""));
    }
    if (r.cu[n - 1] != r.total) {
      value_error(std::string(r.name) + "[-1] must equal the number of tokens (" + std::to_string(r.total) + "), got " +
                  std::to_string(r.cu[n - 1]));
    }
    if (longest > r.max_len) {
      value_error(std::string(r.max_name) + " (" + std::to_string(r.max_len) + ") is shorter than the longest sequence (" +
                  std::to_string(longest) + ")");
    }
  }
}

// After the shape checks: every tensor on q's CUDA device, and an sm80+ GPU there.
void check_devices(std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  const Tensor& q = *tensors.begin()->second;
  for (auto [name, t] : tensors) {
    if (t == nullptr) continue;
    if (!t->is_cuda()) {
      value_error(std::string(name) + " must be a CUDA tensor, got device " + device_str(*t) + ": move it with " + name +
                  ".cuda()");
    }
    if (t->get_device_index() != q.get_device_index()) {
      value_error(std::string(name) + " is on " + device_str(*t) + " but q is on " + device_str(q) +
                  ": put every tensor on one GPU");
    }
  }
}

// fa2.attention_with_kvcache's checks, after which nothing can fail but a launch. The cache is (batch_cache,
// capacity, nheads_k, head_dim), or paged (num_pages, page_size, nheads_k, head_dim) with block_table (batch,
// max_pages); k_new/v_new (batch, seqlen_new, nheads_k, head_dim). Index values on the GPU are not read (that would
// wait for the device on every decode step): the kernels clamp them to the cache.
void check_kvcache(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const std::optional<Tensor>& k_new,
                   const std::optional<Tensor>& v_new, const std::optional<Tensor>& cache_seqlens, int64_t cache_seqlen,
                   const std::optional<Tensor>& cache_batch_idx, const std::optional<Tensor>& block_table,
                   std::optional<double> softmax_scale) {
  if (q.dim() != 4) {
    value_error("q must be 4-D (batch, seqlen_q, nheads, head_dim), got shape " + str(q.sizes()) +
                "; for one decode step per sequence, seqlen_q = 1");
  }
  const int64_t batch = q.size(0), head_dim = q.size(3);
  const std::pair<const char*, const Tensor*> caches[] = {{"k_cache", &k_cache}, {"v_cache", &v_cache}};
  for (auto [name, t] : caches) {
    if (t->dim() != 4) {
      value_error(std::string(name) + " must be 4-D: (batch_cache, capacity, nheads_k, head_dim), or with block_table "
                  "(num_pages, page_size, nheads_k, head_dim); got shape " + str(t->sizes()));
    }
  }
  if (!v_cache.sizes().equals(k_cache.sizes())) {
    value_error("v_cache must have the same shape as k_cache " + str(k_cache.sizes()) + ", got " + str(v_cache.sizes()));
  }
  if (k_new.has_value() != v_new.has_value()) {
    value_error(std::string("k and v (the new keys and values to append) go together, got only ") +
                (k_new ? "k" : "v") + ": pass both, or neither");
  }
  if (k_new && !cache_seqlens && cache_seqlen < 0) {
    value_error("appending k and v needs cache_seqlens, the rows each sequence's cache holds before them");
  }
  // The dtypes, q's layout and head dims, GQA and the scale as for any forward: k_new/v_new stand in for k and v
  // where given, else a (batch, capacity, nheads_k, head_dim) view of the cache's first entries.
  const Tensor& k_like = k_new ? *k_new : k_cache;
  const Tensor& v_like = v_new ? *v_new : v_cache;
  if (k_new && (k_new->dim() != 4 || k_new->size(0) != batch || k_new->size(2) != k_cache.size(2) ||
                k_new->size(3) != k_cache.size(3))) {
    value_error("k must be (batch=" + std::to_string(batch) + ", seqlen_new, nheads_k=" + std::to_string(k_cache.size(2)) +
                ", head_dim=" + std::to_string(k_cache.size(3)) + ") to match q and k_cache, got " + str(k_new->sizes()));
  }
  if (k_cache.size(3) != head_dim) {
    value_error("k_cache's head_dim (" + std::to_string(k_cache.size(3)) + ") must be q's (" + std::to_string(head_dim) +
                ")");
  }
  for (auto [name, t] : caches) {
    if (t->scalar_type() != q.scalar_type()) {
      type_error(std::string(name) + " must have q's dtype " + str(q.scalar_type()) + ", got " + str(t->scalar_type()));
    }
    check_loadable(name, *t);
  }
  if (k_new) {
    check_qkv(q, k_like, v_like, softmax_scale, false);
  } else {
    // check_qkv's checks with the cache standing in for k and v (its batch is checked below).
    check_half("q", q, "");
    check_group(q.size(2), k_cache.size(2), "the cache's");
    check_head_dim(head_dim, "q and the caches", "zero-pad q and the caches (fa2.attention_with_kvcache does)");
    check_loadable("q", q);
    check_scale(softmax_scale);
  }
  if (batch > 65535 || q.size(2) > 65535) {
    value_error("at most 65535 sequences and 65535 heads per call, got q " + str(q.sizes()));
  }
  auto check_index = [&](const char* name, const Tensor& t, std::initializer_list<int64_t> shape, const char* what) {
    if (t.scalar_type() != ScalarType::Int) {
      type_error(std::string(name) + " must be an int32 tensor, got " + str(t.scalar_type()) + ": pass " + name +
                 ".to(torch.int32)");
    }
    if (!t.sizes().equals(Ints(shape)) && !(t.dim() == 2 && shape.size() == 2 && t.size(0) == shape.begin()[0])) {
      value_error(std::string(name) + " must be " + what + ", got shape " + str(t.sizes()));
    }
    if (!t.is_contiguous()) value_error(std::string(name) + " must be contiguous: pass " + name + ".contiguous()");
  };
  if (cache_seqlens) {
    check_index("cache_seqlens", *cache_seqlens, {batch}, "(batch,): the rows each sequence's cache holds");
  }
  if (cache_batch_idx) {
    if (block_table) {
      value_error("cache_batch_idx and block_table cannot be combined: a paged cache names each sequence's pages in "
                  "block_table, so drop cache_batch_idx");
    }
    check_index("cache_batch_idx", *cache_batch_idx, {batch}, "(batch,): the cache entry of each sequence");
  }
  if (block_table) {
    check_index("block_table", *block_table, {batch, -1}, "(batch, max_pages): each sequence's page ids");
    const int64_t page_size = k_cache.size(1);
    if (page_size % kPageRows != 0 || page_size == 0) {
      value_error("a paged cache's page_size (k_cache.shape[1] with block_table) must be a positive multiple of " +
                  std::to_string(kPageRows) + ", got " + std::to_string(page_size));
    }
  } else if (!cache_batch_idx && k_cache.size(0) != batch) {
    value_error("k_cache must have one entry per sequence (batch=" + std::to_string(batch) + ") or cache_batch_idx to "
                "pick them, got k_cache of shape " + str(k_cache.sizes()));
  }
  const int64_t capacity = block_table ? block_table->size(1) * k_cache.size(1) : k_cache.size(1);
  if (capacity > 2147483647) value_error("a cache may hold at most 2**31 - 1 rows, got " + std::to_string(capacity));
  if (!cache_seqlens && cache_seqlen > capacity) {
    value_error("cache_seqlens (" + std::to_string(cache_seqlen) + ") must not exceed the cache's capacity (" +
                std::to_string(capacity) + " rows)");
  }
  if (k_new && !cache_seqlens && cache_seqlen + k_new->size(1) > capacity) {
    value_error("appending " + std::to_string(k_new->size(1)) + " rows after cache_seqlens=" +
                std::to_string(cache_seqlen) + " overflows the cache's capacity (" + std::to_string(capacity) + " rows)");
  }
}

// fa2.attention_with_kvcache's rotary embedding and left padding (flash-attn's rotary_cos/rotary_sin and
// cache_leftpad), after check_kvcache: cos and sin (seqlen_ro, rotary_dim / 2) in q's dtype, contiguous, a row for
// every position the cache holds; new keys to rotate; leftpad (batch,) int32 on an unpaged cache.
void check_rotary_and_leftpad(const Tensor& q, const Tensor& k_cache, const std::optional<Tensor>& k_new,
                              const std::optional<Tensor>& block_table, const std::optional<Tensor>& rotary_cos,
                              const std::optional<Tensor>& rotary_sin, const std::optional<Tensor>& cache_leftpad) {
  const int64_t batch = q.size(0), head_dim = q.size(3);
  const int64_t capacity = block_table ? block_table->size(1) * k_cache.size(1) : k_cache.size(1);
  if (rotary_cos.has_value() != rotary_sin.has_value()) {
    value_error(std::string("rotary_cos and rotary_sin go together, got only ") +
                (rotary_cos ? "rotary_cos" : "rotary_sin") + ": pass both, or neither");
  }
  if (rotary_cos) {
    if (!k_new) {
      value_error("rotary_cos/rotary_sin rotate q and the new keys k as they are appended: pass k and v too (or rotate "
                  "q yourself and leave rotary_cos/rotary_sin None)");
    }
    const std::pair<const char*, const Tensor*> tables[] = {{"rotary_cos", &*rotary_cos}, {"rotary_sin", &*rotary_sin}};
    for (auto [name, t] : tables) {
      if (t->scalar_type() != q.scalar_type()) {
        type_error(std::string(name) + " must have q's dtype " + str(q.scalar_type()) + ", got " +
                   str(t->scalar_type()) + ": pass " + name + ".to(q.dtype)");
      }
      if (t->dim() != 2 || t->size(1) < 1 || 2 * t->size(1) > head_dim) {
        value_error(std::string(name) + " must be (seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= head_dim (" +
                    std::to_string(head_dim) + "), got shape " + str(t->sizes()));
      }
      if (t->size(0) < std::max<int64_t>(capacity, 1) || t->size(0) > 2147483647) {
        value_error(std::string(name) + " must have a row for each of the cache's " + std::to_string(capacity) +
                    " positions (seqlen_ro >= capacity, as in flash-attn), got shape " + str(t->sizes()));
      }
      if (!t->is_contiguous()) value_error(std::string(name) + " must be contiguous: pass " + name + ".contiguous()");
    }
    if (!rotary_sin->sizes().equals(rotary_cos->sizes())) {
      value_error("rotary_sin must have rotary_cos's shape " + str(rotary_cos->sizes()) + ", got " +
                  str(rotary_sin->sizes()));
    }
  }
  if (cache_leftpad) {
    if (block_table) {
      value_error("cache_leftpad and block_table cannot be combined (neither can they in flash-attn): a paged cache "
                  "starts each sequence at row 0 of its first page, so drop cache_leftpad");
    }
    if (cache_leftpad->scalar_type() != ScalarType::Int) {
      type_error("cache_leftpad must be an int32 tensor, got " + str(cache_leftpad->scalar_type()) +
                 ": pass cache_leftpad.to(torch.int32)");
    }
    if (!cache_leftpad->sizes().equals(Ints({batch}))) {
      value_error("cache_leftpad must be (batch,): the first row of each sequence's cache, got shape " +
                  str(cache_leftpad->sizes()));
    }
    if (!cache_leftpad->is_contiguous()) {
      value_error("cache_leftpad must be contiguous: pass cache_leftpad.contiguous()");
    }
  }
}

}  // namespace fa2::host
