// Programmatic dependent launch (PDL, sm90+): a kernel launched with it may start while the kernel ahead of it on the
// stream still runs, so that its launch and prologue hide under that kernel's tail. It must wait before it touches
// what that kernel writes. Used where a short kernel feeds the next (the KV append the decode forward, the forward
// the split-KV combine: docs/tuning.md#pdl). The launch asks for it only where the device code is sm90's
// (FwdPlan::pdl), as sm80 code (an sm80-only build on an H100) has no wait and would read too early.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace fa2 {

// Blocks until the kernel ahead has finished and its writes are visible; a no-op in a kernel launched without PDL.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel launch now, if it was launched with PDL (it still waits for this one in its prologue).
__device__ __forceinline__ void let_next_kernel_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch where `early`.
template <typename... Params, typename... Args>
cudaError_t launch_maybe_early(bool early, void (*kernel)(Params...), dim3 grid, dim3 block, int smem,
                               cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = size_t(smem), config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute, config.numAttrs = early ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace fa2
