// Host-side check (no GPU) of bwd_kernel.h's warp-local dQ slab stores (bench/NOTES.md v9), over every
// thread: the four-base-pointer address equals stage_index(r, c), each warp owns one 32 x 32 slab, fragment
// pairs are adjacent columns, and offsets from a thread's first element are multiples of 8.
//   nvcc -std=c++17 --expt-relaxed-constexpr -I csrc -I <cutlass>/include bench/dq_slab_check.cu \
//        -o /tmp/dq_slab_check && /tmp/dq_slab_check
// 2026-11-23: 0 bad at d64 x 128 rows and d128 x 64 rows.
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
int main() {
  int bad = check_dq_slabs<fa2::BwdTraits<64, 128, 128, 2, fa2::DType::bf16>>();
  bad += check_dq_slabs<fa2::BwdTraits<128, 64, 128, 2, fa2::DType::bf16>>();
  return bad != 0;
}
