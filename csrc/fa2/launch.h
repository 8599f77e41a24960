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

// Shared memory one block may use (A100 163 KB, H100 227 KB, sm86/89 99 KB), or less where the caller says so.
inline int block_smem_limit(const BwdParams& p) {
  const int device = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>("shared memory per block");
  return p.smem_limit > 0 && p.smem_limit < device ? p.smem_limit : device;
}

// Causal grids: how many heads' blocks are dispatched heaviest first together (schedule.h). As many heads
// as have blocks resident at once anyway, so the group's K/V (or Q/dO) stay in L2 as without grouping;
// rounded down to a divisor of nheads.
inline int causal_head_group(const FwdParams& p, int blocks_per_head, int ctas_per_sm) {
  const int resident_heads = ceil_div_host(device_sm_count() * ctas_per_sm, blocks_per_head);
  int group = resident_heads < p.nheads ? resident_heads : p.nheads;
  while (p.nheads % group != 0) --group;
  return group;
}

template <int kHeadDim, DType kDType> void run_fwd(const FwdParams& p, cudaStream_t stream);
template <int kHeadDim, DType kDType> void run_bwd(const BwdParams& p, cudaStream_t stream);

}  // namespace fa2
