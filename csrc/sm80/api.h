// The mma.sync family's entry points, one instantiation per (head dim, dtype) in csrc/instantiations/: each executes
// a launch plan (common/plan.h) that the host made from this family's table (sm80/config.h). No CuTe here: the host
// code includes this, never a kernel header.
#pragma once

#include <cuda_runtime.h>

#include "common/dtype.h"
#include "common/params.h"
#include "common/plan.h"

namespace fa2 {

template <int kHeadDim, DType kDType> void run_fwd(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream);
template <int kHeadDim, DType kDType> void run_bwd(const BwdParams& p, const BwdPlan& plan, cudaStream_t stream);

}  // namespace fa2
