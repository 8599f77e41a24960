// Host-side helpers shared by the host code (csrc/host/) and every family's launches: CUDA error checking, the
// device's attributes, shared-memory opt-in, and the KV append's launch. No CuTe here, so the host code compiles with
// the host compiler.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/dtype.h"
#include "common/params.h"

namespace fa2 {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fa2: ") + what + ": " + cudaGetErrorString(err));
  }
}

inline constexpr int ceil_div_host(int a, int b) { return (a + b - 1) / b; }

// TMA descriptors are encoded by the driver (cuTensorMapEncodeTiled), which needs a context current on the calling
// thread, and a thread gets one from the first runtime call that needs it. A thread whose CUDA work so far came from
// PyTorch's caching allocator (autograd's worker, a checkpointed forward run again, a user's thread) may have none:
// the encode then fails. cudaSetDevice makes the device's primary context current at once (CUDA 12+; PyTorch skips
// it when the device is already the current one). Once per thread and device; not a stream operation, so a CUDA
// graph capture is not disturbed (cudaFree(nullptr), the older idiom, is a call that a capture may refuse).
inline void bind_context() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  thread_local uint64_t bound = 0;
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bound & bit) return;
  check_cuda(cudaSetDevice(device), "binding the device's context to this thread");
  bound |= bit;
}

// Opt a kernel into more than 48 KB of dynamic shared memory. The attribute sticks per device, and setting it
// is a driver call that costs host time on every launch, so it is set once per (kernel, device).
template <auto kKernel>
void allow_smem(int smem, const char* what) {
  if (smem <= 48 * 1024) return;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  static std::atomic<uint64_t> done{0};
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (done.load(std::memory_order_relaxed) & bit) return;
  check_cuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), what);
  done.fetch_or(bit, std::memory_order_relaxed);
}

// An attribute of the current device, queried once per device (a driver call; launches happen every step).
template <cudaDeviceAttr kAttr>
int device_attribute(const char* what) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  static std::atomic<int> cache[64] = {};  // 0 = not asked yet (every attribute used here is >= 1)
  int value = device < 64 ? cache[device].load(std::memory_order_relaxed) : 0;
  if (value == 0) {
    check_cuda(cudaDeviceGetAttribute(&value, kAttr, device), what);
    if (device < 64) cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}
inline int device_cc_major() { return device_attribute<cudaDevAttrComputeCapabilityMajor>("compute capability"); }
inline int device_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>("multiprocessor count"); }

// Shared memory one block may use (A100 163 KB, H100 227 KB, sm86/89/120 99 KB), or less where a test says so
// (FwdParams::smem_limit).
inline int block_smem_limit(const FwdParams& p) {
  const int device = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>("shared memory per block");
  return p.smem_limit > 0 && p.smem_limit < device ? p.smem_limit : device;
}

// The arch a kernel's device code was compiled for, as 80, 90, ...: the PTX target it came from, which decides its
// arch-dependent paths (dq_accum.h). Not the device's compute capability: an sm80-only build runs sm80 code on an
// H100 (through the driver's PTX JIT), and a build for 80 and 90 runs its sm90 code on an sm120 GPU. Queried once
// per (kernel, device).
template <auto kKernel>
int kernel_code_arch() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  static std::atomic<int> cache[64] = {};
  int arch = device < 64 ? cache[device].load(std::memory_order_relaxed) : 0;
  if (arch == 0) {
    cudaFuncAttributes attr{};
    check_cuda(cudaFuncGetAttributes(&attr, kKernel), "cudaFuncGetAttributes");
    arch = attr.ptxVersion;
    if (device < 64) cache[device].store(arch, std::memory_order_relaxed);
  }
  return arch;
}

// The smallest configuration of a kernel needs more shared memory than a block may use here: a clear error instead
// of a failed launch.
[[noreturn]] inline void throw_smem_too_small(const char* kind, int head_dim, int needed, int limit) {
  throw std::runtime_error(std::string("fa2: the ") + kind + " for head_dim " + std::to_string(head_dim) + " needs " +
                           std::to_string(needed) + " bytes of shared memory per block, and a block may use " +
                           std::to_string(limit) + " here; fa2 supports GPUs that allow at least 99 KB (sm80 and up)");
}

void run_kv_append(const KvAppendParams& p, cudaStream_t stream);  // csrc/instantiations/kv_append.cu
// The arch this build's device code runs as on the current device (kernel_code_arch of a kernel every build has): every
// kernel TU is compiled for the same archs, so it is every kernel's. csrc/instantiations/kv_append.cu.
int device_code_arch();

}  // namespace fa2
