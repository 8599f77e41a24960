// The launch plan of a call (common/plan.h), made once, here, from the kernel families' tables, and executed by
// dispatch.h without re-deciding it. Plans read only the launch's parameters and the device, never torch.
#pragma once

#include "common/params.h"
#include "common/plan.h"

namespace fa2::host {

// What a plan depends on beyond the call: the shared memory a block may use, the SMs, and the arch the build's device
// code runs as (common/launch.h: device_code_arch). In record mode (CPU tests, no GPU) the test's smem_limit or an
// unlimited block, no SM count, and the build's highest arch.
struct DeviceInfo {
  int smem_limit = 0, sm_count = 0, code_arch = 0;
  bool sm90a = false;  // the device runs sm_90a code (compute capability 9.0) and the build has the Hopper family
};
DeviceInfo device_info(const FwdParams& p);

// The compiled head dim a call of this head dim and dtype runs (the smallest >= it; the kernel masks the padding
// columns), or a ValueError that says how to rebuild. kind: "fwd" or "bwd".
int pick_head_dim(int head_dim, DType dtype, const char* kind);

// Whether the forward at this compiled head dim reads paged KV caches (sm80/config.h: fwd_reads_pages).
bool reads_pages(int head_dim);
// The compiled head dim a paged KV cache of this head dim runs on: the smallest in the build at or above it whose
// forward reads pages (the kernels mask the columns past the call's head dim); 0 if the build has none.
int pick_paged_head_dim(int head_dim, DType dtype);

// The family a forward runs on: the Hopper family where the device runs it and it serves the call (sm90/config.h:
// fwd_serves), unless the FA2_FAMILY environment variable ("sm80", "sm90") or the test override says otherwise; a
// family that does not serve a call never gets it.
// The forward's plan. Applies it to p: GQA decode packing (seqlen_q, nheads, strides), num_splits and head_group.
// `requested_splits` > 0 is the caller's split count (fa2.attention_with_kvcache's num_splits), used where the
// instance can split; the test override (csrc/CONTRACT.md) wins over it.
// head_dim: the compiled head dim pick_head_dim chose for the call.
FwdPlan plan_forward(FwdParams& p, DType dtype, int head_dim, int requested_splits, const DeviceInfo& device);

// The backward's plan; sets p.head_group.
BwdPlan plan_backward(BwdParams& p, DType dtype, int head_dim, const DeviceInfo& device);

}  // namespace fa2::host
