// pybind11 module fa2._C: validates sizes (a bad call from C++ must never write out of bounds), picks
// the compiled instantiation for the head dim and dtype, and launches on the caller's stream.
// Pointers arrive as integers from torch's data_ptr(); there is no libtorch dependency.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "fa2/launch.h"
#include "fa2_build_config.h"

namespace py = pybind11;
using fa2::DType;

namespace {

using StrideTuple = std::tuple<int64_t, int64_t, int64_t>;

fa2::Strides to_strides(const StrideTuple& s) { return {std::get<0>(s), std::get<1>(s), std::get<2>(s)}; }

template <typename T> T* as_ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

DType parse_dtype(const std::string& s) {
  if (s == "fp16") return DType::fp16;
  if (s == "bf16") return DType::bf16;
  throw std::invalid_argument("fa2: dtype must be 'fp16' or 'bf16', got '" + s + "'");
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument("fa2: " + msg);
}

// The launch runs on the current device; refuse anything that could not execute there. The device's
// properties are checked once (driver calls cost host time on every launch); the current device every time.
void check_device(int device) {
  static std::atomic<uint64_t> checked{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  if (checked.load(std::memory_order_relaxed) & bit) {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == device) return;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw std::runtime_error("fa2: no usable CUDA device (driver missing or no GPU visible)");
  }
  int current = -1;
  fa2::check_cuda(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) {
    throw std::runtime_error("fa2: tensors are on cuda:" + std::to_string(device) + " but the current device is cuda:" +
                             std::to_string(current));
  }
  if (fa2::device_cc_major() < 8) throw std::runtime_error("fa2: needs an sm80+ GPU (Ampere or newer)");
  checked.fetch_or(bit, std::memory_order_relaxed);
}

void check_sizes(const fa2::FwdParams& p) {
  require(p.batch >= 1 && p.seqlen_q >= 1 && p.seqlen_k >= 1, "batch, seqlen_q and seqlen_k must be >= 1");
  require((p.cu_seqlens_q == nullptr) == (p.cu_seqlens_k == nullptr), "pass both cu_seqlens_q and cu_seqlens_k, or neither");
  require(p.cu_seqlens_q == nullptr || (p.total_q >= 0 && p.total_k >= 0 && p.q_stride.batch == 0 && p.o_stride.batch == 0 &&
                                        p.k_stride.batch == 0 && p.v_stride.batch == 0),
          "varlen: total_q/total_k must be >= 0 and the batch strides 0");
  require(p.batch <= 65535, "batch must be <= 65535");
  require(p.nheads >= 1 && p.nheads_k >= 1 && p.nheads % p.nheads_k == 0 && p.nheads <= 65535,
          "nheads must be a positive multiple of nheads_k (and <= 65535)");
  require(p.head_dim >= 8 && p.head_dim % 8 == 0 && p.head_dim <= 256, "head_dim must be a multiple of 8 in [8, 256]");
  // The kernels compute in float with denormals flushed: a scale below FLT_MIN would act as 0, and -inf
  // (masked) scores times 0 are NaN.
  require(std::isfinite(p.softmax_scale) && p.softmax_scale >= FLT_MIN && p.scale_log2 >= FLT_MIN,
          "softmax_scale must be finite and at least 1.2e-38 (float's smallest normal number)");
}

// Test-only launch parameters (csrc/CONTRACT.md: set_test_overrides), process-wide: 0 leaves each to the launch.
// They reach configurations that this GPU would not pick, so that one GPU can test them all; neither changes
// what is computed.
std::atomic<int> g_smem_limit{0};  // shared memory a block may use, below the device's: another GPU's configurations
std::atomic<int> g_head_group{0};  // causal grids: heads whose blocks go heaviest first together

void apply_test_overrides(fa2::FwdParams& p) {
  p.smem_limit = g_smem_limit.load(std::memory_order_relaxed);
  const int group = g_head_group.load(std::memory_order_relaxed);
  require(group == 0 || p.nheads % group == 0, "the test override head_group=" + std::to_string(group) +
                                                   " must divide nheads=" + std::to_string(p.nheads));
  p.head_group = group;
}

void set_test_overrides(int smem_limit, int head_group) {
  require(smem_limit >= 0, "smem_limit must be >= 0 (0: the device's)");
  require(head_group >= 0, "head_group must be >= 0 (0: chosen at launch)");
  g_smem_limit.store(smem_limit, std::memory_order_relaxed);
  g_head_group.store(head_group, std::memory_order_relaxed);
}

// Instantiations compiled into this build, as (head dim, dtype) lists.
struct Instance { int head_dim; DType dtype; };
#define FA2_INSTANCE(D, T) Instance{D, DType::T},
const std::vector<Instance> kFwdInstances = {FA2_FOR_EACH_FWD(FA2_INSTANCE)};
const std::vector<Instance> kBwdInstances = {FA2_FOR_EACH_BWD(FA2_INSTANCE)};
#undef FA2_INSTANCE

// The smallest compiled head dim >= head_dim for this dtype; the kernel masks the padding columns.
int pick_head_dim(const std::vector<Instance>& instances, int head_dim, DType dtype, const char* kind) {
  int best = 0;
  for (const auto& inst : instances) {
    if (inst.dtype == dtype && inst.head_dim >= head_dim && (best == 0 || inst.head_dim < best)) best = inst.head_dim;
  }
  if (best == 0) {
    throw std::invalid_argument(std::string("fa2: this build has no ") + kind + " kernel for head_dim " +
                                std::to_string(head_dim) + " and this dtype (see fa2.build_info())");
  }
  return best;
}

// The forward's fields, shared by both entry points (BwdParams extends FwdParams).
void fill_common(fa2::FwdParams& p, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse,
                 const StrideTuple& q_stride, const StrideTuple& k_stride, const StrideTuple& v_stride,
                 const StrideTuple& out_stride, int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_k,
                 int head_dim, double softmax_scale, bool causal, uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k,
                 int total_q, int total_k) {
  p.q = as_ptr<const void>(q), p.k = as_ptr<const void>(k), p.v = as_ptr<const void>(v);
  p.o = as_ptr<void>(out), p.lse = as_ptr<float>(lse);
  p.q_stride = to_strides(q_stride), p.k_stride = to_strides(k_stride);
  p.v_stride = to_strides(v_stride), p.o_stride = to_strides(out_stride);
  p.batch = batch, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.nheads = nheads, p.nheads_k = nheads_k, p.head_dim = head_dim;
  p.softmax_scale = float(softmax_scale);
  p.scale_log2 = float(softmax_scale * M_LOG2E);
  p.causal = causal;
  p.cu_seqlens_q = as_ptr<const int>(cu_seqlens_q), p.cu_seqlens_k = as_ptr<const int>(cu_seqlens_k);
  p.total_q = total_q, p.total_k = total_k;
  check_sizes(p);
}

void fwd(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, StrideTuple q_stride,
         StrideTuple k_stride, StrideTuple v_stride, StrideTuple out_stride, int batch, int seqlen_q, int seqlen_k,
         int nheads, int nheads_k, int head_dim, double softmax_scale, bool causal, const std::string& dtype,
         int device, uintptr_t stream, uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, int total_q, int total_k) {
  fa2::FwdParams p;
  fill_common(p, q, k, v, out, lse, q_stride, k_stride, v_stride, out_stride, batch, seqlen_q, seqlen_k, nheads,
              nheads_k, head_dim, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, total_q, total_k);
  apply_test_overrides(p);
  const DType dt = parse_dtype(dtype);
  const int kernel_dim = pick_head_dim(kFwdInstances, head_dim, dt, "forward");
  check_device(device);
  auto s = reinterpret_cast<cudaStream_t>(stream);
#define FA2_DISPATCH(D, T) \
  if (kernel_dim == D && dt == DType::T) return fa2::run_fwd<D, DType::T>(p, s);
  FA2_FOR_EACH_FWD(FA2_DISPATCH)
#undef FA2_DISPATCH
  throw std::logic_error("fa2: forward dispatch fell through");
}

void bwd(uintptr_t dout, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, uintptr_t dq,
         uintptr_t dk, uintptr_t dv, uintptr_t dq_accum, uintptr_t d_sum, StrideTuple dout_stride,
         StrideTuple q_stride, StrideTuple k_stride, StrideTuple v_stride, StrideTuple out_stride,
         StrideTuple dq_stride, StrideTuple dk_stride, StrideTuple dv_stride, int batch, int seqlen_q,
         int seqlen_k, int nheads, int nheads_k, int head_dim, double softmax_scale, bool causal,
         bool deterministic, const std::string& dtype, int device, uintptr_t stream, bool dkv_fp32,
         uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, int total_q, int total_k) {
  fa2::BwdParams p;
  fill_common(p, q, k, v, out, lse, q_stride, k_stride, v_stride, out_stride, batch, seqlen_q, seqlen_k, nheads,
              nheads_k, head_dim, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, total_q, total_k);
  p.dout = as_ptr<const void>(dout);
  p.dq = as_ptr<void>(dq), p.dk = as_ptr<void>(dk), p.dv = as_ptr<void>(dv);
  p.dq_accum = as_ptr<float>(dq_accum), p.d_sum = as_ptr<float>(d_sum);
  p.dout_stride = to_strides(dout_stride), p.dq_stride = to_strides(dq_stride);
  p.dk_stride = to_strides(dk_stride), p.dv_stride = to_strides(dv_stride);
  p.deterministic = deterministic;
  p.dkv_fp32 = dkv_fp32;
  apply_test_overrides(p);
  require(p.cu_seqlens_q == nullptr || (p.dout_stride.batch == 0 && p.dq_stride.batch == 0 && p.dk_stride.batch == 0 &&
                                        p.dv_stride.batch == 0),
          "varlen: the batch strides must be 0");
  const DType dt = parse_dtype(dtype);
  const int kernel_dim = pick_head_dim(kBwdInstances, head_dim, dt, "backward");
  check_device(device);
  auto s = reinterpret_cast<cudaStream_t>(stream);
#define FA2_DISPATCH(D, T) \
  if (kernel_dim == D && dt == DType::T) return fa2::run_bwd<D, DType::T>(p, s);
  FA2_FOR_EACH_BWD(FA2_DISPATCH)
#undef FA2_DISPATCH
  (void)s;
  throw std::logic_error("fa2: backward dispatch fell through");
}

py::dict build_info() {
  py::dict info;
  info["version"] = FA2_VERSION;
  info["cuda_version"] = FA2_CUDA_VERSION;
  std::vector<int> archs;
  std::string a = FA2_CUDA_ARCHS;
  for (size_t pos = 0; pos < a.size();) {
    size_t end = a.find(';', pos);
    if (end == std::string::npos) end = a.size();
    std::string tok = a.substr(pos, end - pos);
    if (!tok.empty()) archs.push_back(std::stoi(tok));  // "90a" / "90-real" parse as 90
    pos = end + 1;
  }
  info["archs"] = archs;
  auto dims = [](const std::vector<Instance>& v) {
    std::vector<int> d;
    for (const auto& i : v) {
      bool seen = false;
      for (int x : d) seen |= x == i.head_dim;
      if (!seen) d.push_back(i.head_dim);
    }
    std::sort(d.begin(), d.end());
    return d;
  };
  info["fwd_head_dims"] = dims(kFwdInstances);
  info["bwd_head_dims"] = dims(kBwdInstances);
  std::vector<std::string> dtypes;
  for (const char* name : {"fp16", "bf16"}) {
    for (const auto& i : kFwdInstances) {
      if ((i.dtype == DType::fp16) == (std::string(name) == "fp16")) { dtypes.push_back(name); break; }
    }
  }
  info["dtypes"] = dtypes;
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fa2 CUDA kernels (FlashAttention-2 on CuTe). Use the fa2 Python package, not this module.";
  m.def("set_test_overrides", &set_test_overrides,
        "Test only: launch parameters for every later call (csrc/CONTRACT.md); set_test_overrides() resets them.",
        py::arg("smem_limit") = 0, py::arg("head_group") = 0);
  m.def("build_info", &build_info, "What this build compiled: CUDA version, archs, head dims, dtypes.");
  m.def("fwd", &fwd, "Attention forward on raw device pointers (see csrc/CONTRACT.md).", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("q_stride"), py::arg("k_stride"), py::arg("v_stride"),
        py::arg("out_stride"), py::arg("batch"), py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("nheads"),
        py::arg("nheads_k"), py::arg("head_dim"), py::arg("softmax_scale"), py::arg("causal"), py::arg("dtype"),
        py::arg("device"), py::arg("stream"), py::arg("cu_seqlens_q") = 0, py::arg("cu_seqlens_k") = 0,
        py::arg("total_q") = 0, py::arg("total_k") = 0);
  m.def("bwd", &bwd, "Attention backward on raw device pointers (see csrc/CONTRACT.md).", py::arg("dout"),
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"),
        py::arg("dv"), py::arg("dq_accum"), py::arg("d_sum"), py::arg("dout_stride"), py::arg("q_stride"),
        py::arg("k_stride"), py::arg("v_stride"), py::arg("out_stride"), py::arg("dq_stride"), py::arg("dk_stride"),
        py::arg("dv_stride"), py::arg("batch"), py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("nheads"),
        py::arg("nheads_k"), py::arg("head_dim"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("deterministic"), py::arg("dtype"), py::arg("device"), py::arg("stream"), py::arg("dkv_fp32") = false,
        py::arg("cu_seqlens_q") = 0, py::arg("cu_seqlens_k") = 0, py::arg("total_q") = 0, py::arg("total_k") = 0);
}
