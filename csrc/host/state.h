// What the op code (ops.cpp) and the Python module (module.cpp) share: the compiled instantiations and the
// test-only launch overrides. Nothing here includes torch or Python headers.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "fa2/dtype.h"
#include "fa2/params.h"
#include "fa2_build_config.h"

namespace fa2::host {

struct Instance {
  int head_dim;
  DType dtype;
};
#define FA2_INSTANCE(D, T) Instance{D, DType::T},
inline const std::vector<Instance> kFwdInstances = {FA2_FOR_EACH_FWD(FA2_INSTANCE)};
inline const std::vector<Instance> kBwdInstances = {FA2_FOR_EACH_BWD(FA2_INSTANCE)};
#undef FA2_INSTANCE

// Test-only (csrc/CONTRACT.md: set_test_overrides), process-wide; 0/false leaves each to the launch.
struct TestOverrides {
  std::atomic<int> smem_limit{0};  // shared memory a block may use, below the device's: another GPU's configurations
  std::atomic<int> head_group{0};  // causal grids: heads whose blocks go heaviest first together
  std::atomic<int> num_splits{0};  // forwards: split-KV's split count (config.h: fwd_num_splits), 1..kMaxSplits
  std::atomic<bool> record{false};  // record each launch's parameters instead of launching (CPU tests)
};
inline TestOverrides g_overrides;

// A launch the ops would have made, in record mode: its kind and parameters.
struct RecordedLaunch {
  std::string kind;  // "fwd", "bwd" or "kv_append"
  BwdParams params;  // the forward's fields for "fwd"
  std::string dtype;
  KvAppendParams append = {};  // "kv_append"'s
};
inline std::mutex g_recorded_mutex;
inline std::vector<RecordedLaunch> g_recorded;

}  // namespace fa2::host
