// The launches: a plan (plan.h) handed to its family's entry point for its (head dim, dtype) on the current stream,
// with an NVTX range where FA2_NVTX=1; in record mode (CPU tests) the parameters and the plan are kept instead.
#pragma once

#include <cuda_runtime.h>

#include <optional>

#include "common/params.h"
#include "common/plan.h"

namespace fa2::host {

bool recording();
// torch's current stream on `device`; none where this torch has no CUDA (a CPU-only build, as in CI).
std::optional<cudaStream_t> torch_stream(int device);
void launch_fwd(const FwdParams& p, const FwdPlan& plan, int device);
void launch_bwd(const BwdParams& p, const BwdPlan& plan, int device);
void launch_kv_append(const KvAppendParams& p, int device);

}  // namespace fa2::host
