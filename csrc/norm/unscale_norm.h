// Fused pass over a gradient shard: unscale in place, sum of squares, non-finite check.
#pragma once

#include <cstdint>

#include "dispatch.h"

namespace zengine {

// Multiplies grad[0:n] by `scale` in place (skipped when scale == 1) and returns, in
// *sum_sq, the sum of the squares of the scaled values accumulated in double. A float
// squared is exact in double and n of them cannot overflow it, so *sum_sq is finite exactly
// when every scaled value is finite: that is the non-finite (overflow) check.
// The sum is taken per fixed-size block and the blocks added in order, so it does not depend
// on the thread count. Returns nullptr, or a static error message.
const char* unscale_sum_squares(float* grad, int64_t n, float scale, double* sum_sq,
                                int num_threads, SimdPath path);

}  // namespace zengine
