// Host-only checks of the deterministic Hopper backward's rotated walk (full attention; csrc/sm90/bwd_kernel.h,
// common/schedule.h RotatedTurns): key block n of N starts at query block n mod M and wraps; its turn at a block is
// its rank in the order the key blocks arrive there. For many (N, M): (1) each block's turns are a permutation of
// [0, N); (2) the closed form equals brute force; (3) all CTAs stepping in lockstep under the wait rule finish, in how
// many steps (against key-block order: every CTA walks 0..M-1, turn = n); (4) with fewer CTA slots than key blocks
// the rotated order can deadlock, which is why the launch rotates only where a head's key blocks fit on the GPU.
// Nothing here runs a kernel.
// The lockstep rotated walk takes max(N, M) steps (the lower bound: a block's N adds are serial), key-block order
// N + M - 1.
//   nvcc -std=c++17 -O2 -Icsrc -o /tmp/det_rotate bench/det_rotate.cu && /tmp/det_rotate   # all checks passed
#include <algorithm>
#include <cstdio>
#include <vector>

#include "common/schedule.h"
#include "host_check.h"

using fa2::RotatedTurns;


static int step_of(int n, int r, int M) { return ((r - n) % M + M) % M; }  // t(n, r)

// The definition: key blocks whose (step, n) at block r is lexicographically below n's.
static int brute_turn(int n, int r, int N, int M) {
  int ahead = 0;
  for (int k = 0; k < N; ++k) {
    const int tk = step_of(k, r, M), tn = step_of(n, r, M);
    ahead += tk < tn || (tk == tn && k < n);
  }
  return ahead;
}

// One head's CTAs in lockstep, at most `slots` resident, started in key-block (ticket) order. At each step a resident
// CTA adds into its next block if the block's semaphore equals its turn; the increments are seen the next step.
// Returns the steps to finish, or -1 on a step where nothing moved (a deadlock).
static int simulate(int N, int M, bool rotate, int slots) {
  std::vector<int> sem(M, 0), done(N, 0), turn_of(size_t(N) * M);
  for (int n = 0; n < N; ++n) {
    const RotatedTurns rotated(n, N, M);
    for (int r = 0; r < M; ++r) turn_of[size_t(n) * M + r] = rotate ? rotated(r) : n;
  }
  int started = 0, finished = 0, steps = 0;
  std::vector<int> adds;
  while (finished < N) {
    while (started < N && started - finished < slots) ++started;  // slots free up as CTAs finish
    adds.clear();
    for (int n = 0; n < N && n < started; ++n) {
      if (done[n] == M) continue;
      const int r = rotate ? (n + done[n]) % M : done[n];
      if (sem[r] == turn_of[size_t(n) * M + r]) adds.push_back(n);
    }
    if (adds.empty()) return -1;
    for (int n : adds) {
      const int r = rotate ? (n + done[n]) % M : done[n];
      ++sem[r];
      if (++done[n] == M) ++finished;
    }
    ++steps;
  }
  for (int r = 0; r < M; ++r) CHECK(sem[r] == N, "N=%d M=%d: block %d saw %d adds\n", N, M, r, sem[r]);
  return steps;
}

int main() {
  std::vector<int> sizes;
  for (int v = 1; v <= 40; ++v) sizes.push_back(v);
  for (int v : {47, 63, 64, 65, 96, 127, 128, 129, 131, 132, 200, 256}) sizes.push_back(v);
  int pairs = 0, bad_turns = 0, max_over_bound = 0, old_max_over_bound = 0, worst_n = 0, worst_m = 0;
  for (int N : sizes) {
    for (int M : sizes) {
      ++pairs;
      const int bad_before = bad;
      for (int r = 0; r < M; ++r) {
        std::vector<int> seen(N, 0);
        for (int n = 0; n < N; ++n) {
          const int t = RotatedTurns(n, N, M)(r);
          CHECK(t >= 0 && t < N, "N=%d M=%d r=%d n=%d: turn %d out of range\n", N, M, r, n, t);
          if (t >= 0 && t < N) ++seen[t];
          CHECK(t == brute_turn(n, r, N, M), "N=%d M=%d r=%d n=%d: closed form %d, brute force %d\n", N, M, r, n, t,
                brute_turn(n, r, N, M));
        }
        for (int t = 0; t < N; ++t) {
          CHECK(seen[t] == 1, "N=%d M=%d r=%d: turn %d taken %d times\n", N, M, r, t, seen[t]);
        }
      }
      bad_turns += bad - bad_before;
      const int steps = simulate(N, M, true, N), old_steps = simulate(N, M, false, N);
      CHECK(steps > 0 && old_steps > 0, "N=%d M=%d: deadlock (rotated %d, key-block order %d)\n", N, M, steps,
            old_steps);
      // Lower bound max(N, M): a block takes its N adds one after another, a CTA its M blocks. Rotated meets it: a
      // step's CTAs that share a block (N > M) queue behind each other once, then stay a step apart.
      const int expect = std::max(N, M);
      CHECK(steps == expect, "N=%d M=%d: %d steps, expected %d\n", N, M, steps, expect);
      max_over_bound = std::max(max_over_bound, steps - std::max(N, M));
      if (old_steps - std::max(N, M) > old_max_over_bound) {
        old_max_over_bound = old_steps - std::max(N, M), worst_n = N, worst_m = M;
      }
      CHECK(old_steps == N + M - 1, "N=%d M=%d: key-block order took %d steps\n", N, M, old_steps);
    }
  }
  printf("%d (N, M) pairs, N and M in 1..40 and 47..256: permutations and closed form == brute force: %s\n", pairs,
         bad_turns ? "FAILED" : "ok");
  printf("lockstep, all CTAs resident: no deadlock; steps over the lower bound max(N, M), max over all pairs: rotated "
         "%d, key-block order %d (N=%d M=%d; it takes N + M - 1)\n",
         max_over_bound, old_max_over_bound, worst_n, worst_m);
  printf("  %5s %5s %10s %10s\n", "N", "M", "rotated", "key order");
  for (auto [N, M] : {std::pair{8, 8}, {32, 32}, {128, 128}, {8, 16}, {16, 8}, {12, 8}, {128, 8}, {5, 3}}) {
    printf("  %5d %5d %10d %10d\n", N, M, simulate(N, M, true, N), simulate(N, M, false, N));
  }
  // Fewer slots than key blocks (a head wider than the GPU): rotated waits on higher key blocks that cannot start.
  int deadlocks_small = 0, deadlocks_wide = 0, wide = 0;
  for (int N : sizes) {
    for (int M : sizes) {
      for (int slots : {1, 2, 7, 16, 132}) {
        const int steps = simulate(N, M, true, slots);
        CHECK(simulate(N, M, false, slots) > 0, "N=%d M=%d slots=%d: key-block order deadlocked\n", N, M, slots);
        if (N <= slots) {
          deadlocks_small += steps < 0;
        } else {
          ++wide;
          deadlocks_wide += steps < 0;
        }
      }
    }
  }
  CHECK(deadlocks_small == 0, "%d deadlocks with N <= slots\n", deadlocks_small);
  printf("limited slots (1, 2, 7, 16, 132; CTAs start in key-block order as slots free): N <= slots: %d deadlocks; "
         "N > slots: rotated deadlocked in %d of %d cases, key-block order in none\n",
         deadlocks_small, deadlocks_wide, wide);
  printf("%s\n", bad ? "FAILED" : "all checks passed");
  return bad ? 1 : 0;
}
