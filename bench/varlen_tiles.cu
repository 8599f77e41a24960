// Host-only checks of the Hopper forward's tile numbering (csrc/sm90/tile_scheduler.h) and of varlen's draws: for
// many grids, (1) TileScheduler::index is tile()'s inverse, plain and heaviest first; (2) varlen_tile maps the real
// tiles 0..R-1 onto exactly the grid's tiles that have rows (query block < its sequence's block count), each once,
// and R onward past the grid; (3) within a sequence in the grid's order (plain: head by head, block ascending;
// heaviest first: block descending, heads fastest). The prefix is built here as fwd_launch.h's varlen_tile_prefix
// builds it on the GPU. Nothing here runs a kernel.
//   CUT=$(python -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__)+'/source/include')")
//   nvcc -std=c++17 -I$CUT -Icsrc --expt-relaxed-constexpr -o /tmp/varlen_tiles bench/varlen_tiles.cu
//   /tmp/varlen_tiles   # all checks passed
#include <cstdio>
#include <random>
#include <vector>

#include "host_check.h"
#include "sm90/tile_scheduler.h"

using fa2::sm90::TileScheduler;
using fa2::sm90::WorkTile;

int main() {
  std::mt19937 gen(7);
  int grids = 0, draws = 0;
  for (int num_m = 1; num_m <= 9; ++num_m) {
    for (int nheads = 1; nheads <= 5; ++nheads) {
      for (int batch = 1; batch <= 7; ++batch) {
        for (int heavy = 0; heavy < 2; ++heavy) {
          for (int section = 1; section <= nheads * batch + 1; section += 2) {
            const TileScheduler s{num_m, nheads, batch, section, heavy == 1};
            ++grids;
            for (int t = 0; t < s.num_tiles(); ++t) {
              const WorkTile w = s.tile(t);
              CHECK(s.index(w) == t, "index(tile(%d)) = %d (m %d h %d b %d heavy %d section %d)\n", t, s.index(w),
                    num_m, nheads, batch, heavy, section);
            }
            // Varlen: random block counts per sequence (0 included), the grid's num_m the largest.
            for (int trial = 0; trial < 3; ++trial) {
              std::vector<int> count(batch), blocks(batch + 1, 0);
              for (int b = 0; b < batch; ++b) count[b] = std::uniform_int_distribution<int>(0, num_m)(gen);
              for (int b = 0; b < batch; ++b) blocks[b + 1] = blocks[b] + count[b];
              const int real = blocks[batch] * nheads;
              std::vector<int> seen(s.num_tiles(), 0);
              WorkTile prev{0, 0, -1};
              for (int r = 0; r < real + 3; ++r, ++draws) {
                const int t = fa2::sm90::varlen_tile(s, blocks.data(), r);
                if (r >= real) {
                  CHECK(t == s.num_tiles(), "draw %d past the %d real tiles gave %d\n", r, real, t);
                  continue;
                }
                CHECK(t >= 0 && t < s.num_tiles(), "draw %d gave %d\n", r, t);
                if (t < 0 || t >= s.num_tiles()) continue;
                ++seen[t];
                const WorkTile w = s.tile(t);
                CHECK(w.m_block < count[w.batch], "draw %d: block %d of sequence %d has %d\n", r, w.m_block, w.batch,
                      count[w.batch]);
                if (prev.batch == w.batch) {  // the order within a sequence
                  const bool next = heavy ? (w.m_block == prev.m_block && w.head == prev.head + 1) ||
                                                (w.m_block == prev.m_block - 1 && w.head == 0 && prev.head == nheads - 1)
                                          : (w.head == prev.head && w.m_block == prev.m_block + 1) ||
                                                (w.head == prev.head + 1 && w.m_block == 0);
                  CHECK(next, "draw %d: (m %d, h %d) after (m %d, h %d), heavy %d\n", r, w.m_block, w.head,
                        prev.m_block, prev.head, heavy);
                } else {
                  CHECK(w.batch > prev.batch, "draw %d: sequence %d after %d\n", r, w.batch, prev.batch);
                }
                prev = w;
              }
              for (int t = 0; t < s.num_tiles(); ++t) {
                const WorkTile w = s.tile(t);
                CHECK(seen[t] == (w.m_block < count[w.batch] ? 1 : 0), "tile %d drawn %d times\n", t, seen[t]);
              }
            }
          }
        }
      }
    }
  }
  printf("%d grids, %d varlen draws: %s (%d failures)\n", grids, draws, bad ? "FAILED" : "all checks passed", bad);
  return bad ? 1 : 0;
}
