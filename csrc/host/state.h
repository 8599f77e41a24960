// What the host code (ops, plan, dispatch) and the Python module (module.cpp) share: the compiled instantiations, the
// test-only launch overrides and the recorded launches. Nothing here includes torch or Python headers.
#pragma once

#include <atomic>
#include <cstdlib>
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

// The entries of one of fa2_build_config.h's ;-lists ("80;90", "sm80;sm90;").
inline std::vector<std::string> build_list(const std::string& list) {
  std::vector<std::string> items;
  for (size_t pos = 0; pos < list.size();) {
    size_t end = list.find(';', pos);
    if (end == std::string::npos) end = list.size();
    if (end > pos) items.push_back(list.substr(pos, end - pos));
    pos = end + 1;
  }
  return items;
}
// The archs this build compiled for, as numbers ("90a" and "90-real" count as 90).
inline std::vector<int> built_archs() {
  std::vector<int> archs;
  for (const std::string& a : build_list(FA2_CUDA_ARCHS)) archs.push_back(std::atoi(a.c_str()));
  return archs;
}

// Test-only (csrc/CONTRACT.md: set_test_overrides), process-wide; 0/false leaves each to the launch.
struct TestOverrides {
  std::atomic<int> smem_limit{0};  // shared memory a block may use, below the device's: another GPU's configurations
  std::atomic<int> head_group{0};  // causal grids: heads whose blocks go heaviest first together
  std::atomic<int> num_splits{0};  // forwards: split-KV's split count (sm80/config.h: fwd_num_splits), 1..kMaxSplits
  std::atomic<bool> record{false};  // record each launch's parameters instead of launching (CPU tests)
  std::atomic<int> family{0};       // forwards: 1 mma.sync, 2 Hopper where it serves; 0 the plan's choice
  std::atomic<int> walk_heads{0};   // the Hopper backward's walk: gcd(walk_heads, the K/V group) query heads a tile
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
