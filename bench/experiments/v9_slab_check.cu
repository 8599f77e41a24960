// Host-side check (no GPU) of the v9 patch's dQ slab addressing in bwd_kernel.h (bench/NOTES.md v9): for every
// thread and fragment element of the d64 x 128 and d128 x 64 backward dQ GEMMs, the four-base-pointer
// address equals stage_index(r, c), and the assumptions behind it hold (each warp owns one 32 x 32 slab,
// fragment pairs are adjacent columns, offsets from the first element are multiples of 8).
//   nvcc -std=c++17 --expt-relaxed-constexpr -I csrc -I <cutlass>/include bench/experiments/v9_slab_check.cu \
//        -o /tmp/slab_check && /tmp/slab_check      # 2026-11-23: 4096 + 4096 pairs, 0 bad
#include <cstdio>
#include "fa2/traits.h"
using namespace cute;
template <typename Traits>
int check() {
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
int main() {
  int bad = check<fa2::BwdTraits<64, 128, 128, 2, fa2::DType::bf16>>();
  bad += check<fa2::BwdTraits<128, 64, 128, 2, fa2::DType::bf16>>();
  return bad != 0;
}
