// Host-side declarations shared by the bindings and the kernel TUs: the per-(head dim, dtype) entry
// points and CUDA error checking. No CuTe here, so bindings.cpp compiles with the host compiler.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "fa2/dtype.h"
#include "fa2/params.h"

namespace fa2 {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fa2: ") + what + ": " + cudaGetErrorString(err));
  }
}

inline constexpr int ceil_div_host(int a, int b) { return (a + b - 1) / b; }

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

// Compute capability major of the current device, queried once per device.
inline int device_cc_major() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  static std::atomic<int> cc[64] = {};
  if (device >= 64) {
    int major = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "compute capability");
    return major;
  }
  int major = cc[device].load(std::memory_order_relaxed);
  if (major == 0) {
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "compute capability");
    cc[device].store(major, std::memory_order_relaxed);
  }
  return major;
}

template <int kHeadDim, DType kDType> void run_fwd(const FwdParams& p, cudaStream_t stream);
template <int kHeadDim, DType kDType> void run_bwd(const BwdParams& p, cudaStream_t stream);

}  // namespace fa2
