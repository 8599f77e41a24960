// The launches (dispatch.h).
#include "host/dispatch.h"

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "common/launch.h"
#include "host/state.h"
#include "sm80/api.h"
#include "sm90/api.h"

// In libtorch_cuda, which CPU-only builds of torch lack: weak, so that the module still imports there (CI).
extern "C" __attribute__((weak)) AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret);

namespace fa2::host {
namespace {

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

cudaStream_t current_stream(int device) {
  const std::optional<cudaStream_t> stream = torch_stream(device);
  if (!stream) {
    throw std::runtime_error("fa2: cannot get the current CUDA stream from torch (is this a CUDA build of torch?)");
  }
  return *stream;
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

}  // namespace

std::optional<cudaStream_t> torch_stream(int device) {
  void* stream = nullptr;
  if (aoti_torch_get_current_cuda_stream == nullptr || aoti_torch_get_current_cuda_stream(device, &stream) != 0) {
    return std::nullopt;
  }
  return static_cast<cudaStream_t>(stream);
}

// In record mode (CPU tests) the launch is recorded before the device checks, so CPU tensors go through.
bool recording() { return g_overrides.record.load(std::memory_order_relaxed); }

namespace {

// The stream to launch on, after the GPU checks; none in record mode, where `recorded()` is kept instead.
template <class Recorded>
std::optional<cudaStream_t> stream_for(int device, Recorded&& recorded) {
  if (recording()) {
    std::lock_guard<std::mutex> lock(g_recorded_mutex);
    g_recorded.push_back(recorded());
    return std::nullopt;
  }
  check_gpu(device);
  return current_stream(device);
}

}  // namespace

void launch_fwd(const FwdParams& p, const FwdPlan& plan, int device) {
  const auto stream = stream_for(device, [&] {
    RecordedLaunch launch{"fwd", {}, dtype_name(plan.dtype)};
    static_cast<FwdParams&>(launch.params) = p;
    launch.fwd_plan = plan;
    return launch;
  });
  if (!stream) return;
  NvtxRange range("fa2.fwd");
#define FA2_DISPATCH(D, T) \
  if (plan.head_dim == D && plan.dtype == DType::T) return run_fwd<D, DType::T>(p, plan, *stream);
#define FA2_DISPATCH_SM90(D, T) \
  if (plan.head_dim == D && plan.dtype == DType::T) return sm90::run_fwd<D, DType::T>(p, plan, *stream);
  if (plan.family == Family::kSm90) {
    FA2_FOR_EACH_SM90_FWD(FA2_DISPATCH_SM90)
  } else {
    FA2_FOR_EACH_SM80_FWD(FA2_DISPATCH)
  }
#undef FA2_DISPATCH_SM90
#undef FA2_DISPATCH
  throw std::logic_error("fa2: forward dispatch fell through");
}

void launch_bwd(const BwdParams& p, const BwdPlan& plan, int device) {
  const auto stream = stream_for(device, [&] {
    RecordedLaunch launch{"bwd", p, dtype_name(plan.dtype)};
    launch.bwd_plan = plan;
    return launch;
  });
  if (!stream) return;
  NvtxRange range("fa2.bwd");
#define FA2_DISPATCH(D, T) \
  if (plan.head_dim == D && plan.dtype == DType::T) return run_bwd<D, DType::T>(p, plan, *stream);
#define FA2_DISPATCH_SM90(D, T) \
  if (plan.head_dim == D && plan.dtype == DType::T) return sm90::run_bwd<D, DType::T>(p, plan, *stream);
  if (plan.family == Family::kSm90) {
    FA2_FOR_EACH_SM90_BWD(FA2_DISPATCH_SM90)
  } else {
    FA2_FOR_EACH_SM80_BWD(FA2_DISPATCH)
  }
#undef FA2_DISPATCH_SM90
#undef FA2_DISPATCH
  throw std::logic_error("fa2: backward dispatch fell through");
}

void launch_kv_append(const KvAppendParams& p, int device) {
  const auto stream = stream_for(device, [&] {
    RecordedLaunch launch{"kv_append", BwdParams{}, "any"};
    launch.append = p;
    return launch;
  });
  if (stream) run_kv_append(p, *stream);
}

}  // namespace fa2::host
