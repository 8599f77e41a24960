// Host-side checks (no GPU) of two layout facts the v9 patch relies on (bench/NOTES.md v9), over every thread:
// 1. bwd_kernel.h's dQ slab stores: the four-base-pointer address equals stage_index(r, c), each warp owns one
//    32 x 32 slab, fragment pairs are adjacent columns, offsets from the first element are multiples of 8.
// 2. traits.h's contiguous warp rows (FA2_FWD_WARP_SKIP): warp w's S and O elements all lie in rows
//    [w * kWarpRows, (w + 1) * kWarpRows), and every element of S belongs to exactly one thread.
// With the patch applied:
//   nvcc -std=c++17 --expt-relaxed-constexpr -DFA2_FWD_WARP_SKIP=1 -I csrc -I <cutlass>/include \
//        bench/experiments/v9_layout_check.cu -o /tmp/layout_check && /tmp/layout_check
// 2026-11-23: all 0 bad.
#include <cstdio>
#include "fa2/traits.h"
using namespace cute;

template <typename Traits>
int check_dq_slabs() {
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim, kSlab = 32;
  using BlockQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  typename Traits::TiledMmadQ mma_dq;
  auto stage_index = [](int r, int c) { return r * kSlab + ((((c >> 3) ^ r) & 3) << 3) + (c & 7); };
  int bad = 0, n = 0;
  for (int tid = 0; tid < 256; ++tid) {
    Tensor coord = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(BlockQ{}));
    const int row0 = get<0>(coord(0)) / kSlab * kSlab, col0 = get<1>(coord(0)) / kSlab * kSlab;
    const int r0 = get<0>(coord(0)) - row0, c0 = get<1>(coord(0)) - col0;
    for (int i = 0; i < size(coord); i += 2) {
      const int r = get<0>(coord(i)) - row0, c = get<1>(coord(i)) - col0;
      const int dr = get<0>(coord(i)) - get<0>(coord(0)), dc = get<1>(coord(i)) - get<1>(coord(0));
      // the slab must be this warp's own 32 x 32 square, and (i, i+1) adjacent columns
      if (r < 0 || r >= kSlab || c < 0 || c >= kSlab || get<1>(coord(i + 1)) != get<1>(coord(i)) + 1 ||
          get<0>(coord(i + 1)) != get<0>(coord(i))) { ++bad; continue; }
      if (dc < 0 || dc % 8 || dr < 0 || dr % 8) { ++bad; continue; }
      const int fast = stage_index(r0, c0 + 8 * (dc / 8)) + dr * kSlab;
      if (fast != stage_index(r, c)) ++bad;
      ++n;
    }
  }
  printf("d%d x %d rows: %d element pairs checked, %d bad\n", kHeadDim, kBlockM, n, bad);
  return bad;
}
template <typename Traits>
int check_warp_rows() {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  typename Traits::TiledMma mma;
  int bad = 0;
  for (int tid = 0; tid < Traits::kNThreads; ++tid) {
    auto thr = mma.get_thread_slice(tid);
    Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cO = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    const int w = tid / 32, lo = w * Traits::kWarpRows, hi = lo + Traits::kWarpRows;
    for (int i = 0; i < size(cS); ++i) { int r = get<0>(cS(i)); if (r < lo || r >= hi) ++bad; }
    for (int i = 0; i < size(cO); ++i) { int r = get<0>(cO(i)); if (r < lo || r >= hi) ++bad; }
  }
  // every (row, col) of S covered exactly once
  static int seen[256][256];
  for (auto& a : seen) for (auto& b : a) b = 0;
  for (int tid = 0; tid < Traits::kNThreads; ++tid) {
    Tensor cS = mma.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    for (int i = 0; i < size(cS); ++i) seen[get<0>(cS(i))][get<1>(cS(i))]++;
  }
  for (int r = 0; r < kBlockM; ++r) for (int c = 0; c < kBlockN; ++c) if (seen[r][c] != 1) ++bad;
  printf("d%d %dx%d %d warps: %d bad\n", kHeadDim, kBlockM, kBlockN, Traits::kNWarps, bad);
  return bad;
}
int main() {
  int bad = check_dq_slabs<fa2::BwdTraits<64, 128, 128, 2, fa2::DType::bf16>>();
  bad += check_dq_slabs<fa2::BwdTraits<128, 64, 128, 2, fa2::DType::bf16>>();
  bad += check_warp_rows<fa2::FwdTraits<64, 128, 64, 4, 1, fa2::DType::bf16>>();
  bad += check_warp_rows<fa2::FwdTraits<128, 128, 64, 4, 1, fa2::DType::bf16>>();
  bad += check_warp_rows<fa2::FwdTraits<256, 128, 64, 8, 1, fa2::DType::bf16>>();
  return bad != 0;
}
