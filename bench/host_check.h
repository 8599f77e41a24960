// What the host-only checks of kernel index mappings share (bench/det_rotate.cu, bwd_wide_maps.cu,
// dq_swap_maps.cu): a failure counter with the first ten messages printed. Nothing here runs a kernel.
#pragma once

#include <cstdio>

inline int bad = 0;
#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) {                       \
      if (bad < 10) printf(__VA_ARGS__); \
      ++bad;                             \
    }                                    \
  } while (0)
