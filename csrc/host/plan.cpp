// The launch plans (plan.h): one function per direction turns a call's parameters into the plan its launch executes.
#include "host/plan.h"

#include <climits>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>

#include "common/launch.h"
#include "host/errors.h"
#include "host/state.h"
#include "sm80/config.h"
#include "sm90/config.h"

namespace fa2::host {
namespace {

// The highest arch this build compiled for ("80;90" -> 90).
int highest_built_arch() {
  int best = 0;
  for (int arch : built_archs()) best = std::max(best, arch);
  return best;
}

// Decoding with GQA (one query row, several query heads per K/V head): the heads of a group become the rows of one
// query block (seqlen_q = group, nheads = nheads_k), so a CTA reads its K/V once for all of them, not once per head.
// lse's (batch, nheads, 1) rows are the packed (batch, nheads_k, group) ones. With one query row the causal mask
// and a right bound exclude nothing, so they are dropped; a left bound, ALiBi, a sink or dropout depend on the row
// or the head and keep the layout as it is.
bool pack_gqa_decode(FwdParams& p) {
  if (p.cu_seqlens_q != nullptr || p.seqlen_q != 1 || p.nheads == p.nheads_k || p.window_left >= 0 ||
      p.alibi_slopes != nullptr || p.sink != nullptr || p.rng_state != nullptr) {
    return false;
  }
  const int group = p.nheads / p.nheads_k;
  p.seqlen_q = group, p.nheads = p.nheads_k;
  // Query head h * group + g of row 0 becomes row g of head h: rows step by the head stride, heads by group of them.
  p.q_stride = {p.q_stride.batch, p.q_stride.head, group * p.q_stride.head};
  p.o_stride = {p.o_stride.batch, p.o_stride.head, group * p.o_stride.head};
  p.window_right = -1;
  return true;
}

// The smallest instance that covers the call's per-score transforms (common/plan.h: ScoreTransforms).
ScoreTransforms main_transforms(const FwdParams& p) {
  if (p.rng_state != nullptr) return ScoreTransforms::kAll;
  if (p.softcap_in > 0.f || p.alibi_slopes != nullptr || p.window_left >= 0 || p.num_splits > 1) {
    return ScoreTransforms::kLogits;
  }
  return ScoreTransforms::kNone;
}

// Split-KV's count (sm80/config.h: fwd_num_splits), or the test override's, or the caller's. Only the kLogits
// instances split, so a call with dropout runs whole, override or not. In record mode no call is split unless the
// override says so.
int num_splits(const FwdParams& p, const FwdPlan& plan, int requested, const DeviceInfo& device) {
  if (p.rng_state != nullptr) return 1;
  const int override_splits = g_overrides.num_splits.load(std::memory_order_relaxed);
  const int forced = override_splits > 0 ? override_splits : requested;
  if (forced > 0) return forced;
  if (device.sm_count == 0) return 1;
  const long long ctas = 1ll * ceil_div_host(p.seqlen_q, plan.shape.block_m) * p.nheads * p.batch;
  const int slots = device.sm_count * fwd_ctas_per_sm(plan.shape.warps);
  return fwd_num_splits(ctas, p.batch, slots, ceil_div_host(p.seqlen_k, plan.shape.block_n));
}

// Causal grids go heaviest block first within groups of heads (common/schedule.h): the test override's group, or as
// many heads as are resident at once (sm80/config.h: causal_head_group); 1 in record mode; 0 (the plain order) when
// not causal.
// heads: the grid's (the Hopper backward's walks, below); a forced group then the largest that divides them.
int head_group(const FwdParams& p, int resident_ctas, int blocks_per_head, int heads) {
  if (!p.causal()) return 0;
  const int forced = g_overrides.head_group.load(std::memory_order_relaxed);
  if (forced > 0) return std::gcd(forced, heads);
  return resident_ctas > 0 ? causal_head_group(heads, resident_ctas, blocks_per_head) : 1;
}
int head_group(const FwdParams& p, int resident_ctas, int blocks_per_head) {
  return head_group(p, resident_ctas, blocks_per_head, p.nheads);
}

// The Hopper backward's walk (sm90/bwd_kernel.h): a tile visits `walk` query heads of one K/V group and sums their
// dK and dV in registers, where one tile per query head would write each head's in fp32 for the host to sum (the
// reduce and the stores cost a GQA group of 4 ~25% of its time at 1k: docs/tuning.md#sm90-backward). A walk is a
// longer tile, and fewer tiles can leave SMs idle. Full attention's tiles are equal, so a launch takes its waves
// times a walk: the longest walk (a divisor of the group) of the fewest such steps. Causal tiles are not (key block 0
// sees every query), so there the whole group only while the grid keeps at least two tiles per SM, else the largest
// divisor of the group that does, down to 1; deterministic, twelve: its CTAs start lightest first (bwd_kernel.h's
// turns), so the heaviest tiles end the launch, and a walk multiplies that tail (docs/tuning.md#sm90-backward). Record
// mode (no SM count): the whole group. The test override forces gcd(override, group).
int walk_heads(const BwdParams& p, int block_n, int sm_count) {
  const int group = p.nheads / p.nheads_k;
  const int forced = g_overrides.walk_heads.load(std::memory_order_relaxed);
  if (forced > 0) return std::gcd(forced, group);
  if (sm_count == 0) return group;
  const long long tiles_per_head = 1ll * ceil_div_host(p.seqlen_k, block_n) * p.batch;
  int best = 1;
  long long best_steps = LLONG_MAX;
  for (int walk = group; walk >= 1; --walk) {
    if (group % walk != 0) continue;
    const long long tiles = tiles_per_head * (p.nheads / walk);
    if (p.causal()) {
      if (walk == 1 || tiles >= (p.deterministic ? 12ll : 2ll) * sm_count) return walk;
    } else if (const long long steps = (tiles + sm_count - 1) / sm_count * walk; steps < best_steps) {
      best = walk, best_steps = steps;  // waves x walk
    }
  }
  return best;
}

// Whether the build has the Hopper family's forward or backward at (head_dim, dtype) (instantiations/axes.json).
bool sm90_built(bool backward, int head_dim, DType dtype) {
#define FA2_SM90(D, T) \
  if (head_dim == D && dtype == DType::T) return true;
  if (backward) {
    FA2_FOR_EACH_SM90_BWD(FA2_SM90)
  } else {
    FA2_FOR_EACH_SM90_FWD(FA2_SM90)
  }
#undef FA2_SM90
  return false;
}

// TMA reads q, k and v (and writes o) through descriptors whose base must be 16-byte aligned and whose strides must
// be multiples of 16 bytes, even along a dimension of size 1 (where the checks in host/checks.cpp let any through).
bool tma_aligned(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }
bool tma_tensor(const void* ptr, const Strides& s) {
  return tma_aligned(ptr) && s.batch % 8 == 0 && s.row % 8 == 0 && s.head % 8 == 0;
}

// The family a call asks for: the test override, else FA2_FAMILY, else none (0: either; 1: sm80; 2: sm90).
int requested_family() {
  const int forced = g_overrides.family.load(std::memory_order_relaxed);
  if (forced != 0) return forced;
  static const int env = [] {
    const char* v = std::getenv("FA2_FAMILY");
    return v == nullptr ? 0 : std::string(v) == "sm80" ? 1 : std::string(v) == "sm90" ? 2 : 0;
  }();
  return env;
}

Family forward_family(const FwdParams& p, DType dtype, int head_dim, const DeviceInfo& device) {
  // The compiled head dim exactly, as for the backward: the Hopper forward pads no head dim (a build without the
  // call's own, FA2_HEAD_DIMS, runs it padded on the mma.sync family).
  if (requested_family() == 1 || !device.sm90a || head_dim != p.head_dim) return Family::kSm80;
  const bool serves = sm90_built(false, head_dim, dtype) &&
                      sm90::fwd_serves(p.head_dim, p.seqlen_q, p.cache.capacity > 0 || p.cache.block_table != nullptr,
                                       p.window_left, p.window_right,
                                       p.softcap_in > 0.f, p.alibi_slopes != nullptr, p.sink != nullptr,
                                       p.rng_state != nullptr) &&
                      tma_tensor(p.q, p.q_stride) && tma_tensor(p.k, p.k_stride) && tma_tensor(p.v, p.v_stride) &&
                      tma_tensor(p.o, p.o_stride) &&
                      sm90::fwd_smem_bytes(sm90::fwd_tile(head_dim), head_dim) <= device.smem_limit;
  return serves ? Family::kSm90 : Family::kSm80;
}

// The backward's family: the Hopper one where the build compiled it, for what it serves
// (sm90/config.h: bwd_serves), with TMA-loadable q, k, v and dout; FA2_FAMILY=sm80 keeps it off.
Family backward_family(const BwdParams& p, DType dtype, int head_dim, const DeviceInfo& device) {
  // The compiled head dim exactly: a build without the call's own (FA2_HEAD_DIMS) would pad it, which the Hopper
  // backward does not.
  if (requested_family() == 1 || !device.sm90a || head_dim != p.head_dim || !sm90_built(true, head_dim, dtype)) {
    return Family::kSm80;
  }
  const bool serves = sm90::bwd_serves(p.head_dim, p.window_left, p.window_right, p.softcap_in > 0.f,
                                       p.alibi_slopes != nullptr, p.rng_state != nullptr) &&
                      tma_tensor(p.q, p.q_stride) && tma_tensor(p.k, p.k_stride) && tma_tensor(p.v, p.v_stride) &&
                      tma_tensor(p.dout, p.dout_stride) && tma_aligned(p.lse) && tma_aligned(p.d_sum) &&
                      // lse and D: one flat TMA each; the deterministic semaphores (batch, nheads, query blocks)
                      int64_t(p.batch) * p.nheads * p.seqlen_q <= INT32_MAX &&
                      int64_t(p.nheads) * p.total_q <= INT32_MAX &&  // packed: (nheads, total_q)
                      int64_t(p.batch) * p.nheads * ((p.seqlen_k + 63) / 64) <= INT32_MAX &&  // the tiles, an int
                      sm90::bwd_smem_bytes(sm90::bwd_tile(head_dim, p.causal(), p.cu_seqlens_q != nullptr)) <=
                          device.smem_limit;
  return serves ? Family::kSm90 : Family::kSm80;
}

}  // namespace

DeviceInfo device_info(const FwdParams& p) {
  if (g_overrides.record.load(std::memory_order_relaxed)) {
    // No GPU: the Hopper family is planned only where a test's override asks for it (and the build has its arch).
    const int arch = highest_built_arch();
    const bool asked = g_overrides.family.load(std::memory_order_relaxed) == 2;
    return {p.smem_limit > 0 ? p.smem_limit : INT_MAX, 0, arch, arch >= 90 && asked};
  }
  const bool sm90a = device_cc_major() == 9 && device_attribute<cudaDevAttrComputeCapabilityMinor>("cc minor") == 0;
  return {block_smem_limit(p), device_sm_count(), device_code_arch(), sm90a};
}

int pick_head_dim(int head_dim, DType dtype, const char* kind) {
  const std::vector<Instance>& instances = std::string(kind) == "fwd" ? kFwdInstances : kBwdInstances;
  int best = 0;
  bool has_dtype = false;
  for (const auto& inst : instances) {
    if (inst.dtype != dtype) continue;
    has_dtype = true;
    if (inst.head_dim >= head_dim && (best == 0 || inst.head_dim < best)) best = inst.head_dim;
  }
  if (best != 0) return best;
  if (!has_dtype) {
    value_error(std::string("this build of fa2 has no ") + dtype_name(dtype) + " " + kind +
                " kernels: cast q, k and v, or rebuild with FA2_DTYPES including " + dtype_name(dtype) +
                " (see fa2.build_info())");
  }
  std::string dims;
  for (const auto& inst : instances) {
    if (inst.dtype == dtype) dims += (dims.empty() ? "" : ", ") + std::to_string(inst.head_dim);
  }
  value_error("head_dim " + std::to_string(head_dim) + " needs a " + kind + " kernel for a head dim >= " +
              std::to_string(head_dim) + ", and this build has [" + dims +
              "]: rebuild with FA2_HEAD_DIMS including one");
}

bool reads_pages(int head_dim) { return fwd_reads_pages(head_dim); }

int pick_paged_head_dim(int head_dim, DType dtype) {
  int best = 0;
  for (const auto& inst : kFwdInstances) {
    if (inst.dtype == dtype && inst.head_dim >= head_dim && fwd_reads_pages(inst.head_dim) &&
        (best == 0 || inst.head_dim < best)) {
      best = inst.head_dim;
    }
  }
  return best;
}

FwdPlan plan_forward(FwdParams& p, DType dtype, int head_dim, int requested_splits, const DeviceInfo& device) {
  FwdPlan plan;
  plan.head_dim = head_dim;
  plan.dtype = dtype;
  plan.family = forward_family(p, dtype, plan.head_dim, device);
  if (plan.family == Family::kSm90) {  // one tile, whole calls, its own causal order (sm90/fwd_kernel.h)
    plan.tile = FwdTile::kMain;
    plan.shape = sm90::fwd_tile(plan.head_dim);
    plan.transforms = ScoreTransforms::kNone;
    p.num_splits = plan.num_splits = 1;
    p.head_group = plan.head_group = 0;
    return plan;
  }
  plan.paged = p.cache.block_table != nullptr;
  plan.pdl = device.code_arch >= 90;
  plan.pack_gqa = pack_gqa_decode(p);
  plan.tile = fwd_tile_for(plan.head_dim, p.seqlen_q, p.seqlen_k, p.causal(), p.rng_state != nullptr,
                           device.smem_limit, plan.paged);
  plan.shape = fwd_tile_shape(plan.tile, plan.head_dim);
  p.num_splits = plan.num_splits = num_splits(p, plan, requested_splits, device);
  // The 64-row tiles run their kLogits instance, the narrow one its kAll instance for a call with dropout
  // (sm80/config.h: fwd_narrow_runs_all; never split); the main tile the smallest that covers.
  plan.transforms = plan.tile == FwdTile::kNarrow   ? (p.rng_state != nullptr ? ScoreTransforms::kAll
                                                                              : ScoreTransforms::kLogits)
                    : plan.tile == FwdTile::kDecode ? ScoreTransforms::kLogits
                                                    : main_transforms(p);
  const int resident = device.sm_count * fwd_ctas_per_sm(plan.shape.warps);
  p.head_group = plan.head_group = head_group(p, resident, ceil_div_host(p.seqlen_q, plan.shape.block_m));
  return plan;
}

BwdPlan plan_backward(BwdParams& p, DType dtype, int head_dim, const DeviceInfo& device) {
  BwdPlan plan;
  plan.head_dim = head_dim;
  plan.dtype = dtype;
  plan.family = backward_family(p, dtype, head_dim, device);
  if (plan.family == Family::kSm90) {
    plan.shape = sm90::bwd_tile(plan.head_dim, p.causal(), p.cu_seqlens_q != nullptr);
    plan.walk_heads = walk_heads(p, plan.shape.block_n, device.sm_count);
  } else {
    plan.tile = bwd_tile_for(plan.head_dim, device.smem_limit, device.code_arch >= 90);
    plan.shape = bwd_tile_shape(plan.tile, plan.head_dim);
  }
  // Either family: one CTA per SM (sm80: 8 warps of ~250 registers), causal key blocks heaviest first in head groups.
  p.head_group = plan.head_group = head_group(p, device.sm_count, ceil_div_host(p.seqlen_k, plan.shape.block_n),
                                              p.nheads / plan.walk_heads);
  return plan;
}

}  // namespace fa2::host
