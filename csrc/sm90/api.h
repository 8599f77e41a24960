// The Hopper family's entry point, one instantiation per (head dim, dtype) in csrc/instantiations/ (sm_90a code): it
// executes a launch plan (common/plan.h) that the host made from this family's table (sm90/config.h). No CuTe here.
#pragma once

#include <cuda_runtime.h>

#include "common/dtype.h"
#include "common/params.h"
#include "common/plan.h"

namespace fa2::sm90 {

template <int kHeadDim, DType kDType> void run_fwd(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream);
// At the head dims it has a tile for (sm90/config.h: bwd_has_tile; instantiations/axes.json).
template <int kHeadDim, DType kDType> void run_bwd(const BwdParams& p, const BwdPlan& plan, cudaStream_t stream);

}  // namespace fa2::sm90
