// What the host code (ops, plan, dispatch) and the Python module (module.cpp) share: the compiled instantiations, the
// test-only launch overrides and the recorded launches. Nothing here includes torch or Python headers.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/params.h"
#include "common/plan.h"
#include "fa2_build_config.h"

namespace fa2::host {

struct Instance {
  int head_dim;
  DType dtype;
};
#define FA2_INSTANCE(D, T) Instance{D, DType::T},
inline const std::vector<Instance> kFwdInstances = {FA2_FOR_EACH_SM80_FWD(FA2_INSTANCE)};
inline const std::vector<Instance> kBwdInstances = {FA2_FOR_EACH_SM80_BWD(FA2_INSTANCE)};
#undef FA2_INSTANCE

// Test-only (csrc/CONTRACT.md: set_test_overrides), process-wide; 0/false leaves each to the launch.
struct TestOverrides {
  std::atomic<int> smem_limit{0};  // shared memory a block may use, below the device's: another GPU's configurations
  std::atomic<int> head_group{0};  // causal grids: heads whose blocks go heaviest first together
  std::atomic<int> num_splits{0};  // forwards: split-KV's split count (sm80/config.h: fwd_num_splits), 1..kMaxSplits
  std::atomic<bool> record{false};  // record each launch's parameters instead of launching (CPU tests)
  std::atomic<int> family{0};       // forwards: 1 the mma.sync family, 2 the Hopper family where it serves; 0 the plan's
};
inline TestOverrides g_overrides;

// A launch the ops would have made, in record mode: its kind, parameters and plan.
struct RecordedLaunch {
  std::string kind;  // "fwd", "bwd" or "kv_append"
  BwdParams params;  // the forward's fields for "fwd"
  std::string dtype;
  KvAppendParams append = {};  // "kv_append"'s
  FwdPlan fwd_plan = {};
  BwdPlan bwd_plan = {};
};
inline std::mutex g_recorded_mutex;
inline std::vector<RecordedLaunch> g_recorded;

}  // namespace fa2::host
