// The host checks' CuTe part (bench/bwd_wide_maps.cu, dq_swap_maps.cu): a tiled MMA's accumulator stored to shared
// memory by stmatrix, emulated. Nothing here runs a kernel.
#pragma once

#include <vector>

#include <cute/tensor.hpp>

#include "host_check.h"

// stmatrix emulated from the copy atom's own thread/value layouts: within a warp, lane l's source value v is element
// ValLayoutSrc(l, v) of the atom's reference tile, and the lane l' with ValLayoutDst(l', v') equal to it supplies the
// address (partition_D's coordinate of its value v'). Each register of the MMA's accumulator (coordinates in Tile,
// rows x cols) must land on its own coordinate, and every cell of the tile once. `what` names the tile in messages.
template <class Atom, class Tile, class TiledMma>
void check_stmatrix(TiledMma const& mma, int rows, int cols, const char* what) {
  using namespace cute;
  typename Atom::ValLayoutSrc src_tv;
  typename Atom::ValLayoutDst dst_tv;
  constexpr int kSrcVals = size<1>(src_tv), kDstVals = size<1>(dst_tv);
  std::vector<int> hit(rows * cols, 0);
  auto r2s = make_tiled_copy_C(Atom{}, mma);
  for (int warp = 0; warp < int(size(mma)) / 32; ++warp) {
    for (int lane = 0; lane < 32; ++lane) {
      const int tid = warp * 32 + lane;
      Tensor c = mma.get_thread_slice(tid).partition_C(make_identity_tensor(Tile{}));
      Tensor src = r2s.get_thread_slice(tid).retile_S(c);  // the accumulator's coordinates, in the copy's order
      const int calls = size(src) / kSrcVals;
      for (int k = 0; k < calls; ++k) {
        for (int v = 0; v < kSrcVals; ++v) {
          const int ref = src_tv(lane, v);
          int found = 0;
          for (int l2 = 0; l2 < 32; ++l2) {
            for (int v2 = 0; v2 < kDstVals; ++v2) {
              if (dst_tv(l2, v2) != ref) continue;
              Tensor dst = r2s.get_thread_slice(warp * 32 + l2).partition_D(make_identity_tensor(Tile{}));
              const auto to = dst(v2 + kDstVals * k), from = src(v + kSrcVals * k);
              CHECK(to == from, "%s stmatrix tid %d call %d v %d\n", what, tid, k, v);
              if (!found) hit[get<0>(to) * cols + get<1>(to)]++;
              ++found;
            }
          }
          CHECK(found >= 1, "%s stmatrix tid %d call %d v %d: no destination\n", what, tid, k, v);
        }
      }
    }
  }
  for (int x : hit) CHECK(x == 1, "%s cell stored %d times\n", what, x);
}
