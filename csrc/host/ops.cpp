// fa2's CUDA ops, registered through the LibTorch Stable ABI: argument checks (the messages name the argument and
// the fix), allocation through torch's caching allocator, the current stream, and the launch. Schemas, fake
// implementations and autograd live in python/fa2/ops.py; this file only implements the kernels behind them, so
// one build serves every torch from TORCH_TARGET_VERSION on.
//
// Errors: std::invalid_argument reaches Python as ValueError, std::runtime_error as RuntimeError. Python has no
// exception for TypeError to come from, so those messages start with "TypeError: " and fa2's Python layer
// re-raises them as TypeError.
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <charconv>
#include <climits>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
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

#include "fa2/launch.h"  // first: cuda_runtime.h, which config.h's __host__ __device__ needs
#include "fa2/config.h"
#include "host/state.h"

// In libtorch_cuda, which CPU-only builds of torch lack: weak, so that the module still imports there (CI).
extern "C" __attribute__((weak)) AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret);

namespace fa2::host {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;
using Ints = torch::headeronly::IntHeaderOnlyArrayRef;

// ------------------------------------------------------------------------------------------- messages
[[noreturn]] void value_error(const std::string& msg) { throw std::invalid_argument(msg); }
[[noreturn]] void type_error(const std::string& msg) { throw std::invalid_argument("TypeError: " + msg); }

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
DType to_dtype(ScalarType t) { return t == ScalarType::Half ? DType::fp16 : DType::bf16; }
const char* dtype_name(DType t) { return t == DType::fp16 ? "fp16" : "bf16"; }

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
void check_loadable(const char* name, const Tensor& t, const char* fix_like = nullptr) {
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

// q, k, v and the scale, before any device check (so CPU tensors reach every message). Padded batches are
// (batch, seqlen, nheads, head_dim); packed ones (varlen) (total_tokens, nheads, head_dim).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, std::optional<double> softmax_scale, bool varlen) {
  const std::pair<const char*, const Tensor*> qkv[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  for (auto [name, t] : qkv) {
    if (!is_half(t->scalar_type())) {
      type_error(std::string(name) + " must be float16 or bfloat16, got " + str(t->scalar_type()) + ": cast it (e.g. " +
                 name + ".to(torch.bfloat16)), or call fa2.attention inside torch.autocast");
    }
  }
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
  const int64_t nheads_k = k.size(-2);
  if (nheads_k == 0 || nheads % nheads_k != 0) {
    value_error("q's nheads (" + std::to_string(nheads) + ") must be a multiple of k's and v's nheads_k (" +
                std::to_string(nheads_k) + ") (GQA/MQA: each K/V head serves nheads // nheads_k query heads)");
  }
  if (head_dim % 8 != 0 || head_dim < 8 || head_dim > 256) {
    value_error("head_dim (last dim of q, k, v) must be a multiple of 8 in [8, 256], got " + std::to_string(head_dim) +
                ": zero-pad q, k and v to a multiple of 8 (and pass softmax_scale for the true head_dim)");
  }
  for (auto [name, t] : qkv) check_loadable(name, *t);
  // The online softmax keeps the max of unscaled scores, which is only the max of scaled ones for scale > 0; the
  // kernels scale in float with denormals flushed, where a smaller scale is 0 and masked scores NaN.
  if (softmax_scale.has_value() && !(std::isfinite(*softmax_scale) && *softmax_scale >= FLT_MIN)) {
    value_error("softmax_scale must be a positive finite number (at least 1.18e-38, float's smallest normal) or None "
                "(head_dim ** -0.5), got " + str(*softmax_scale));
  }
  const int64_t kIntMax = 2147483647;
  if (q.size(-3) > kIntMax || k.size(-3) > kIntMax || nheads > 65535) {
    value_error("q and k may have at most 2**31 - 1 tokens and 65535 heads, got q " + str(q.sizes()) + " and k " +
                str(k.sizes()));
  }
}

// The options beyond plain attention (flash-attn's semantics, fa2.reference): the band of visible keys, softcap,
// ALiBi slopes, and (forward only) the per-head sink logits.
struct Features {
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  const Tensor* alibi_slopes = nullptr;
  double dropout_p = 0.0;
  const Tensor* rng_state = nullptr;
  const Tensor* sink = nullptr;
};

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

// cu_seqlens: types and shapes always; the values where reading them is allowed (not while a CUDA graph is
// captured). The kernels clamp whatever they read to the tensors' bounds, so unchecked bad values give wrong
// numbers, never out-of-bounds accesses.
void check_cu_seqlens(const Tensor& q, const Tensor& k, const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                      int64_t max_k) {
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
    if (aoti_torch_get_current_cuda_stream == nullptr) return;
    void* stream = nullptr;
    torch::stable::accelerator::DeviceGuard guard(cu_q.get_device_index());
    if (aoti_torch_get_current_cuda_stream(cu_q.get_device_index(), &stream) != 0) return;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capturing) != cudaSuccess ||
        capturing != cudaStreamCaptureStatusNone) {
      cudaGetLastError();
      return;
    }
    auto s = static_cast<cudaStream_t>(stream);
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

// The smallest compiled head dim >= head_dim for this dtype; the kernel masks the padding columns.
int pick_head_dim(const std::vector<Instance>& instances, int head_dim, DType dtype, const char* kind) {
  int best = 0;
  bool has_dtype = false;
  for (const auto& inst : instances) {
    if (inst.dtype != dtype) continue;
    has_dtype = true;
    if (inst.head_dim >= head_dim && (best == 0 || inst.head_dim < best)) best = inst.head_dim;
  }
  if (best != 0) return best;
  if (!has_dtype) {
    value_error(std::string("this build of fa2 has no ") + dtype_name(dtype) + " " + kind + " kernels: cast q, k and v, "
                "or rebuild with FA2_DTYPES including " + dtype_name(dtype) + " (see fa2.build_info())");
  }
  std::string dims;
  for (const auto& inst : instances) {
    if (inst.dtype == dtype) dims += (dims.empty() ? "" : ", ") + std::to_string(inst.head_dim);
  }
  value_error("head_dim " + std::to_string(head_dim) + " needs a " + kind + " kernel for a head dim >= " +
              std::to_string(head_dim) + ", and this build has [" + dims + "]: rebuild with FA2_HEAD_DIMS including one");
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

// The device's properties are checked once (driver calls cost host time on every launch).
void check_gpu(int device) {
  static std::atomic<uint64_t> checked{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  if (checked.load(std::memory_order_relaxed) & bit) return;
  const int major = device_cc_major();
  if (major < 8) {
    int minor = 0;
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    throw std::runtime_error("fa2 needs an sm80+ GPU (Ampere or newer); cuda:" + std::to_string(device) + " is sm" +
                             std::to_string(major) + std::to_string(minor));
  }
  checked.fetch_or(bit, std::memory_order_relaxed);
}

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

// ------------------------------------------------------------------------------------------- launch
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
  p.causal = p.window_right == 0;
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
  const int group = g_overrides.head_group.load(std::memory_order_relaxed);
  if (group != 0 && p.nheads % group != 0) {
    value_error("the test override head_group=" + std::to_string(group) + " must divide nheads=" +
                std::to_string(p.nheads));
  }
  p.head_group = group;
}

cudaStream_t current_stream(int device) {
  void* stream = nullptr;
  if (aoti_torch_get_current_cuda_stream == nullptr || aoti_torch_get_current_cuda_stream(device, &stream) != 0) {
    throw std::runtime_error("fa2: cannot get the current CUDA stream from torch (is this a CUDA build of torch?)");
  }
  return static_cast<cudaStream_t>(stream);
}

// FA2_NVTX=1: an NVTX range around every launch (fa2.fwd / fa2.bwd), for Nsight timelines and `ncu --nvtx`. Off by
// default: a range costs host time.
bool nvtx_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("FA2_NVTX");
    return env != nullptr && env[0] != '\0' && std::string(env) != "0";
  }();
  return on;
}

struct NvtxRange {
  bool on;
  explicit NvtxRange(const char* name) : on(nvtx_enabled()) { if (on) nvtxRangePushA(name); }
  ~NvtxRange() { if (on) nvtxRangePop(); }
};

// In record mode (CPU tests) the launch is recorded before the device checks, so CPU tensors go through.
bool recording() { return g_overrides.record.load(std::memory_order_relaxed); }

// The stream to launch on after the GPU checks; nothing in record mode, where the parameters are kept instead.
template <class Params>
std::optional<cudaStream_t> launch_stream(const char* kind, const Params& p, DType dtype, int device) {
  if (recording()) {
    BwdParams kept;
    static_cast<Params&>(kept) = p;
    std::lock_guard<std::mutex> lock(g_recorded_mutex);
    g_recorded.push_back({kind, kept, dtype_name(dtype)});
    return std::nullopt;
  }
  check_gpu(device);
  return current_stream(device);
}

// kernel_dim: pick_head_dim's choice, made before anything was allocated.
void launch_fwd(const FwdParams& p, DType dtype, int kernel_dim, int device) {
  const std::optional<cudaStream_t> stream = launch_stream("fwd", p, dtype, device);
  if (!stream) return;
  NvtxRange range("fa2.fwd");
#define FA2_DISPATCH(D, T) \
  if (kernel_dim == D && dtype == DType::T) return run_fwd<D, DType::T>(p, *stream);
  FA2_FOR_EACH_FWD(FA2_DISPATCH)
#undef FA2_DISPATCH
  throw std::logic_error("fa2: forward dispatch fell through");
}

void launch_kv_append(const KvAppendParams& p, int device) {
  if (recording()) {
    RecordedLaunch launch{"kv_append", BwdParams{}, "any"};
    launch.append = p;
    std::lock_guard<std::mutex> lock(g_recorded_mutex);
    g_recorded.push_back(launch);
    return;
  }
  check_gpu(device);
  run_kv_append(p, current_stream(device));
}

void launch_bwd(const BwdParams& p, DType dtype, int kernel_dim, int device) {
  const std::optional<cudaStream_t> stream = launch_stream("bwd", p, dtype, device);
  if (!stream) return;
  NvtxRange range("fa2.bwd");
#define FA2_DISPATCH(D, T) \
  if (kernel_dim == D && dtype == DType::T) return run_bwd<D, DType::T>(p, *stream);
  FA2_FOR_EACH_BWD(FA2_DISPATCH)
#undef FA2_DISPATCH
  throw std::logic_error("fa2: backward dispatch fell through");
}


// ------------------------------------------------------------------------------------------- the forward
// Decoding with GQA (one query row, several query heads per K/V head): the heads of a group become the rows of one
// query block (seqlen_q = group, nheads = nheads_k), so a CTA reads its K/V once for all of them, not once per head.
// lse's (batch, nheads, 1) rows are the packed (batch, nheads_k, group) ones. With one query row the causal mask
// and a right bound exclude nothing, so they are dropped; a left bound, ALiBi, a sink or dropout depend on the row
// or the head and keep the layout as it is.
void pack_gqa_decode(FwdParams& p, const Tensor& q, const Tensor& out) {
  if (p.cu_seqlens_q != nullptr || p.seqlen_q != 1 || p.nheads == p.nheads_k || p.window_left >= 0 ||
      p.alibi_slopes != nullptr || p.sink != nullptr || p.rng_state != nullptr) {
    return;
  }
  const int group = p.nheads / p.nheads_k;
  p.seqlen_q = group, p.nheads = p.nheads_k;
  p.q_stride = {q.stride(0), q.stride(2), group * q.stride(2)};
  p.o_stride = {out.stride(0), out.stride(2), group * out.stride(2)};
  p.window_right = -1, p.causal = false;
}

// The geometry of the tile a forward runs (config.h: fwd_tile_for), which sizes its grid, and whether it is the
// narrow tile, which has no split-KV.
struct FwdTileShape {
  int block_m, block_n, ctas_per_sm;
  bool narrow;
};
template <typename Config>
constexpr FwdTileShape fwd_tile_shape(bool narrow) {
  return {Config::kBlockM, Config::kBlockN, fwd_ctas_per_sm(Config::kNWarps), narrow};
}
template <int D>
FwdTileShape fwd_tile_shape_of(const FwdParams& p, int smem_limit) {
  switch (fwd_tile_for<D>(p.seqlen_q, p.seqlen_k, p.causal, p.rng_state != nullptr, smem_limit,
                          p.cache.block_table != nullptr)) {
    case FwdTile::kNarrow: return fwd_tile_shape<FwdNarrowConfig<D>>(true);
    case FwdTile::kDecode: return fwd_tile_shape<FwdDecodeConfig<D>>(false);
    default: return fwd_tile_shape<FwdConfig<D>>(false);
  }
}
FwdTileShape fwd_tile_shape(const FwdParams& p, int kernel_dim, int smem_limit) {
  switch (kernel_dim) {
    case 32: return fwd_tile_shape_of<32>(p, smem_limit);
    case 64: return fwd_tile_shape_of<64>(p, smem_limit);
    case 96: return fwd_tile_shape_of<96>(p, smem_limit);
    case 128: return fwd_tile_shape_of<128>(p, smem_limit);
    case 160: return fwd_tile_shape_of<160>(p, smem_limit);
    case 192: return fwd_tile_shape_of<192>(p, smem_limit);
    case 224: return fwd_tile_shape_of<224>(p, smem_limit);
    default: return fwd_tile_shape_of<256>(p, smem_limit);
  }
}

// Whether the forward of this compiled head dim reads paged KV caches (config.h: fwd_reads_pages).
bool reads_pages(int kernel_dim) {
  switch (kernel_dim) {
#define FA2_PAGES(D) case D: return fwd_reads_pages<D>;
    FA2_PAGES(32) FA2_PAGES(64) FA2_PAGES(96) FA2_PAGES(128) FA2_PAGES(160) FA2_PAGES(192) FA2_PAGES(224)
    FA2_PAGES(256)
#undef FA2_PAGES
    default: return false;
  }
}

// Split-KV's count (config.h: fwd_num_splits), or the test override's, or the caller's (`requested` > 0). Only the
// kLogits instances split, so a call with dropout, or one that takes the narrow tile (short d256 sequences, d224/d256
// on 99 KB GPUs), runs whole, override or not. In record mode (CPU tests) there is no GPU: the tile is chosen for the
// test's smem_limit (or an unlimited block), and no call is split unless the override says so.
int num_splits(const FwdParams& p, int kernel_dim, int requested) {
  if (p.rng_state != nullptr) return 1;
  const int override_splits = g_overrides.num_splits.load(std::memory_order_relaxed);
  const int forced = override_splits > 0 ? override_splits : requested;
  const int smem_limit = !recording() ? block_smem_limit(p) : p.smem_limit > 0 ? p.smem_limit : INT_MAX;
  const FwdTileShape tile = fwd_tile_shape(p, kernel_dim, smem_limit);
  if (tile.narrow) return 1;
  if (forced > 0) return forced;
  if (recording()) return 1;
  const long long ctas = 1ll * ceil_div_host(p.seqlen_q, tile.block_m) * p.nheads * p.batch;
  return fwd_num_splits(ctas, p.batch, device_sm_count() * tile.ctas_per_sm, ceil_div_host(p.seqlen_k, tile.block_n));
}

// The launch of a forward whose parameters are filled: GQA decode packing, split-KV's count (`forced_splits` if > 0,
// where the instance can split) and its workspaces.
void launch_forward(FwdParams& p, const Tensor& q, const Tensor& out, const Tensor& lse, DType dtype, int kernel_dim,
                    int forced_splits) {
  pack_gqa_decode(p, q, out);
  std::optional<Tensor> o_partial, lse_partial;  // split-KV's workspaces, alive until the launches are queued
  p.num_splits = num_splits(p, kernel_dim, forced_splits);
  if (p.num_splits > 1) {
    p.lse_rows = lse.numel();
    lse_partial = new_tensor(q, {p.num_splits, p.lse_rows}, ScalarType::Float);
    o_partial = new_tensor(q, {p.num_splits, p.lse_rows, p.head_dim}, ScalarType::Float);
    p.lse_partial = static_cast<float*>(lse_partial->data_ptr());
    p.o_partial = static_cast<float*>(o_partial->data_ptr());
  }
  launch_fwd(p, dtype, kernel_dim, q.get_device_index());
}

// Padded when cu_q is null. Writes into `out` when given. Returns (out, lse).
std::tuple<Tensor, Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* cu_q,
                                   const Tensor* cu_k, int64_t max_q, int64_t max_k, std::optional<double> softmax_scale,
                                   bool causal, const Features& f, std::optional<Tensor> out_buffer) {
  const bool varlen = cu_q != nullptr;
  check_qkv(q, k, v, softmax_scale, varlen);
  check_buffer("out", out_buffer, q, "q");
  if (varlen) check_cu_seqlens(q, k, *cu_q, *cu_k, max_q, max_k);
  check_features(f, causal, q, varlen ? cu_q->numel() - 1 : q.size(0));
  if (!recording()) {
    check_devices({{"q", &q}, {"k", &k}, {"v", &v}, {"out", out_buffer ? &*out_buffer : nullptr},
                   {"cu_seqlens_q", cu_q}, {"cu_seqlens_k", cu_k}, {"sink", f.sink},
                   {"alibi_slopes", f.alibi_slopes}, {"rng_state", f.dropout_p > 0.0 ? f.rng_state : nullptr}});
  }
  const DType dtype = to_dtype(q.scalar_type());
  const int kernel_dim = pick_head_dim(kFwdInstances, int(q.size(-1)), dtype, "fwd");  // before any allocation
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
  launch_forward(p, q, out, lse, dtype, kernel_dim, 0);
  return {out, lse};
}

// ------------------------------------------------------------------------------------------- the KV cache
const Tensor* opt(const std::optional<Tensor>& t) { return t ? &*t : nullptr; }
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
    if (!is_half(q.scalar_type())) {
      type_error("q must be float16 or bfloat16, got " + str(q.scalar_type()) + ": cast it (e.g. q.to(torch.bfloat16))");
    }
    const int64_t nheads_k = k_cache.size(2);
    if (nheads_k == 0 || q.size(2) % nheads_k != 0) {
      value_error("q's nheads (" + std::to_string(q.size(2)) + ") must be a multiple of the cache's nheads_k (" +
                  std::to_string(nheads_k) + ") (GQA/MQA: each K/V head serves nheads // nheads_k query heads)");
    }
    if (head_dim % 8 != 0 || head_dim < 8 || head_dim > 256) {
      value_error("head_dim (last dim of q and the caches) must be a multiple of 8 in [8, 256], got " +
                  std::to_string(head_dim) + ": zero-pad q and the caches (fa2.attention_with_kvcache does)");
    }
    check_loadable("q", q);
    if (softmax_scale.has_value() && !(std::isfinite(*softmax_scale) && *softmax_scale >= FLT_MIN)) {
      value_error("softmax_scale must be a positive finite number (at least 1.18e-38, float's smallest normal) or "
                  "None (head_dim ** -0.5), got " + str(*softmax_scale));
    }
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

std::tuple<Tensor, Tensor> fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, std::optional<Tensor> k_new,
                                       std::optional<Tensor> v_new, std::optional<Tensor> cache_seqlens,
                                       int64_t cache_seqlen, std::optional<Tensor> cache_batch_idx,
                                       std::optional<Tensor> block_table, std::optional<double> softmax_scale,
                                       bool causal, int64_t window_left, int64_t window_right, double softcap,
                                       std::optional<Tensor> alibi_slopes, std::optional<Tensor> sink,
                                       int64_t num_splits) {
  check_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_seqlen, cache_batch_idx, block_table,
                softmax_scale);
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), 0.0, nullptr, opt(sink)};
  check_features(f, causal, q, q.size(0));
  if (num_splits < 0 || num_splits > kMaxSplits) {
    value_error("num_splits must be 0 (chosen by fa2) or a split count in [1, " + std::to_string(kMaxSplits) +
                "], got " + std::to_string(num_splits));
  }
  if (!recording()) {
    check_devices({{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"k", opt(k_new)}, {"v", opt(v_new)},
                   {"cache_seqlens", opt(cache_seqlens)}, {"cache_batch_idx", opt(cache_batch_idx)},
                   {"block_table", opt(block_table)}, {"sink", f.sink}, {"alibi_slopes", f.alibi_slopes}});
  }
  const DType dtype = to_dtype(q.scalar_type());
  const int kernel_dim = pick_head_dim(kFwdInstances, int(q.size(-1)), dtype, "fwd");
  if (block_table && !reads_pages(kernel_dim)) {
    value_error("a paged KV cache (block_table) needs head_dim 64, 128, 224 or 256 (the kernels with a 64-row tile), "
                "got " + std::to_string(q.size(-1)) + ": use a cache with one entry per sequence (cache_batch_idx "
                "picks them), or zero-pad the head dim");
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
  if (k_new && k_new->numel() > 0) {
    KvAppendParams a;
    a.k_new = k_new->data_ptr(), a.v_new = v_new->data_ptr();
    a.k_new_stride = strides_of(*k_new), a.v_new_stride = strides_of(*v_new);
    a.k_cache = k_cache.data_ptr(), a.v_cache = v_cache.data_ptr();
    a.k_cache_stride = strides_of(k_cache), a.v_cache_stride = strides_of(v_cache);
    a.batch = int(q.size(0)), a.seqlen_new = int(k_new->size(1)), a.nheads_k = int(k_cache.size(2));
    a.row_bytes = int(k_cache.size(3)) * 2;
    a.cache = cache;
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
  fill_common(p, q, k_cache, v_cache, out, lse, s, softmax_scale, causal, f, nullptr, nullptr);
  p.cache = cache;
  launch_forward(p, q, out, lse, dtype, kernel_dim, int(num_splits));
  return {out, lse};
}

// ------------------------------------------------------------------------------------------- the backward
std::tuple<Tensor, Tensor, Tensor> backward(const Tensor& dout_in, const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& out, const Tensor& lse, const Tensor* cu_q, const Tensor* cu_k,
                                            int64_t max_q, int64_t max_k, std::optional<double> softmax_scale,
                                            bool causal, const Features& f, bool deterministic,
                                            std::optional<Tensor> dq_buffer, std::optional<Tensor> dk_buffer,
                                            std::optional<Tensor> dv_buffer) {
  const bool varlen = cu_q != nullptr;
  check_qkv(q, k, v, softmax_scale, varlen);
  if (varlen) {
    check_bwd_tensors(dout_in, q, k, v, out, lse, dq_buffer, dk_buffer, dv_buffer, {q.size(1), q.size(0)}, "fwd_varlen");
    check_cu_seqlens(q, k, *cu_q, *cu_k, max_q, max_k);
  } else {
    check_bwd_tensors(dout_in, q, k, v, out, lse, dq_buffer, dk_buffer, dv_buffer, {q.size(0), q.size(2), q.size(1)},
                      "fwd");
  }
  check_features(f, causal, q, varlen ? cu_q->numel() - 1 : q.size(0));
  if (!recording()) {
    check_devices({{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout_in}, {"lse", &lse},
                   {"dq", dq_buffer ? &*dq_buffer : nullptr}, {"dk", dk_buffer ? &*dk_buffer : nullptr},
                   {"dv", dv_buffer ? &*dv_buffer : nullptr}, {"cu_seqlens_q", cu_q}, {"cu_seqlens_k", cu_k},
                   {"alibi_slopes", f.alibi_slopes}, {"rng_state", f.dropout_p > 0.0 ? f.rng_state : nullptr}});
  }
  const DType dtype = to_dtype(q.scalar_type());
  const int kernel_dim = pick_head_dim(kBwdInstances, int(q.size(-1)), dtype, "bwd");
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
    return {dq, dk, dv};
  }
  // The kernels write dK and dV per query head. For GQA/MQA those slices are float32 and each group is summed before
  // the one rounding to the input dtype (rounding each slice first loses accuracy).
  const int64_t nheads = q.size(-2), nheads_k = k.size(-2), head_dim = q.size(-1);
  const bool grouped = nheads != nheads_k;
  Tensor dk_heads = dk, dv_heads = dv;
  if (grouped) {
    dk_heads = varlen ? new_tensor(q, {k.size(0), nheads, head_dim}, ScalarType::Float)
                      : new_tensor(q, {k.size(0), k.size(1), nheads, head_dim}, ScalarType::Float);
    dv_heads = varlen ? new_tensor(q, {k.size(0), nheads, head_dim}, ScalarType::Float)
                      : new_tensor(q, {k.size(0), k.size(1), nheads, head_dim}, ScalarType::Float);
  }
  Tensor dq_accum = varlen ? new_tensor(q, {nheads, q.size(0), head_dim}, ScalarType::Float)
                           : new_tensor(q, {q.size(0), nheads, q.size(1), head_dim}, ScalarType::Float);
  Tensor d_sum = varlen ? new_tensor(lse, {lse.size(0), lse.size(1)}) : new_tensor(lse, {lse.size(0), lse.size(1), lse.size(2)});
  BwdParams p;
  fill_common(p, q, k, v, out, lse, s, softmax_scale, causal, f, cu_q, cu_k);
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr(), p.dk = dk_heads.data_ptr(), p.dv = dv_heads.data_ptr();
  p.dq_accum = static_cast<float*>(dq_accum.data_ptr()), p.d_sum = static_cast<float*>(d_sum.data_ptr());
  p.dout_stride = strides_of(dout), p.dq_stride = strides_of(dq);
  p.dk_stride = strides_of(dk_heads), p.dv_stride = strides_of(dv_heads);
  p.deterministic = deterministic;
  p.dkv_fp32 = grouped;
  launch_bwd(p, dtype, kernel_dim, q.get_device_index());
  if (grouped) {
    const int64_t group = nheads / nheads_k;
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

// The backward needs no sink: the forward's lse includes it, so the recomputed P is right (its gradient is
// computed in Python from lse and rowsum(dO * O)). ALiBi slopes get no gradient, as in flash-attn.
std::tuple<Tensor, Tensor, Tensor> bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                                       std::optional<double> softmax_scale, bool causal, bool deterministic,
                                       int64_t window_left, int64_t window_right, double softcap,
                                       std::optional<Tensor> alibi_slopes, double dropout_p,
                                       std::optional<Tensor> rng_state) {
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), dropout_p, opt(rng_state), nullptr};
  return backward(dout, q, k, v, out, lse, nullptr, nullptr, 0, 0, softmax_scale, causal, f, deterministic,
                  std::nullopt, std::nullopt, std::nullopt);
}

std::tuple<Tensor, Tensor, Tensor> bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                                              Tensor cu_seqlens_q, Tensor cu_seqlens_k, int64_t max_seqlen_q,
                                              int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal,
                                              bool deterministic, int64_t window_left, int64_t window_right,
                                              double softcap, std::optional<Tensor> alibi_slopes, double dropout_p,
                                              std::optional<Tensor> rng_state) {
  const Features f{window_left, window_right, softcap, opt(alibi_slopes), dropout_p, opt(rng_state), nullptr};
  return backward(dout, q, k, v, out, lse, &cu_seqlens_q, &cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                  causal, f, deterministic, std::nullopt, std::nullopt, std::nullopt);
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
           dk, dv);
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
}
