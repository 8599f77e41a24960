// The end of one row's online softmax, for both families' finalize (sm80/softmax.h, sm90/softmax.h): from the row's
// running max m (in the scores' units; -inf: no visible key) and its sum l of exponentials, the factor O's row is
// multiplied by and the row's lse (natural log). scale: what the scores are scaled by; out_scale: dropout's
// 1 / (1 - p), else 1. A sink logit (nullptr: none) joins l as exp(sink) with no value, the max raised to it first so
// that nothing overflows. A row with l == 0 (no visible key and no sink): O = 0, lse = -inf.
#pragma once

#include <cmath>

namespace fa2 {

struct RowEnd {
  float o_scale;
  float lse;
};

__device__ __forceinline__ RowEnd row_end(float m, float l, float scale, const float* sink, float out_scale) {
  float row_max = m == -INFINITY ? -INFINITY : m * scale;  // natural-log units
  float o_factor = 1.f;                                     // what O's row is multiplied by before 1 / l
  if (sink != nullptr) {
    const float raised = fmaxf(row_max, *sink);
    o_factor = row_max == -INFINITY ? 0.f : __expf(row_max - raised);
    l = l * o_factor + __expf(*sink - raised);
    row_max = raised;
  }
  const bool empty = l == 0.f || l != l;
  return {empty ? 0.f : o_factor * out_scale / l, empty ? -INFINITY : row_max + __logf(l)};
}

}  // namespace fa2
