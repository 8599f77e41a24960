// Dropout on the mma.sync family's score fragments: which of a thread's scores each Philox block (common/philox.h)
// decides, for the m16n8 accumulator layout.
#pragma once

#include <cute/tensor.hpp>

#include "common/philox.h"
#include "common/params.h"
#include "sm80/utils.h"

namespace fa2 {
using namespace cute;

// Calls f(mi, ni, kept) for every element of an accumulator tile (rowcol view: rows r, r + 8 of each 16-row atom at
// mi = 2m, 2m + 1; columns c, c + 1 of each 8-column atom at ni = 2a, 2a + 1). kPartnerAtoms: how many atoms after a
// thread's atom its atom 32 columns on comes, when the tile holds it (the forward's 64- and 128-key tiles: 4; the
// backward's 2 x 4-warp S/dP tiles: 1); 0 where tiles are 32 keys wide and each atom draws a block of its own.
// kInline: Philox inlined (the forward) or called (the backward).
template <int kPartnerAtoms, bool kInline, typename TensorS, typename CoordS, typename F>
__device__ __forceinline__ void for_each_kept(TensorS const& acc, CoordS const& coord, DropoutDraw const& draw,
                                              int row_offset, int col_offset, F&& f) {
  Tensor s = make_tensor(acc.data(), rowcol_layout(acc.layout()));
  Tensor c = make_tensor(coord.data(), rowcol_layout(coord.layout()));
  constexpr int kAtoms = decltype(size<1>(s))::value / 2;
  static_assert(kPartnerAtoms == 0 || kAtoms % (2 * (kPartnerAtoms > 0 ? kPartnerAtoms : 1)) == 0);  // no "% 0" warning
  // Rows r (bit 3 clear: tiles start at multiples of 16) and r + 8 read output words x/z and y/w.
  auto visit = [&](int mi, int ni, uint32_t row_r, uint32_t row_r8) {
    f(mi, ni, draw.kept(row_r, 0)), f(mi, ni + 1, draw.kept(row_r, 1));
    f(mi + 1, ni, draw.kept(row_r8, 0)), f(mi + 1, ni + 1, draw.kept(row_r8, 1));
  };
  CUTE_UNROLL
  for (int m = 0; m < decltype(size<0>(s))::value / 2; ++m) {
    const int row = row_offset + get<0>(c(2 * m, 0));
    CUTE_UNROLL
    for (int a = 0; a < kAtoms; ++a) {
      const int col = col_offset + get<1>(c(0, 2 * a));
      if constexpr (kPartnerAtoms > 0) {
        if ((a / kPartnerAtoms) % 2 == 0) {  // bit 5 of col clear; its partner's set
          const uint4 r = draw.template block<kInline>(row, col);
          visit(2 * m, 2 * a, r.x, r.y);
          visit(2 * m, 2 * (a + kPartnerAtoms), r.z, r.w);
        }
      } else {
        const uint4 r = draw.template block<kInline>(row, col);
        const bool high = (col & 32) != 0;
        visit(2 * m, 2 * a, high ? r.z : r.x, high ? r.w : r.y);
      }
    }
  }
}

}  // namespace fa2
