// Host-side declarations shared by the bindings and the kernel TUs: the per-(head dim, dtype) entry
// points and CUDA error checking. No CuTe here, so bindings.cpp compiles with the host compiler.
#pragma once

#include <cuda_runtime.h>

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

template <int kHeadDim, DType kDType> void run_fwd(const FwdParams& p, cudaStream_t stream);
template <int kHeadDim, DType kDType> void run_bwd(const BwdParams& p, cudaStream_t stream);

}  // namespace fa2
