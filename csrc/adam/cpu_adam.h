// Adam / AdamW step over one flat fp32 shard, in place, in one pass over memory.
#pragma once

#include <cstdint>

#include "dispatch.h"

namespace zengine {

// Optional second destination for the updated parameters, written in the same pass.
enum class CopyOut : int { kNone = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

struct AdamShard {
  float* param;        // [n] fp32, updated in place
  const float* grad;   // [n] fp32
  float* exp_avg;      // [n] fp32, first moment
  float* exp_avg_sq;   // [n] fp32, second moment
  int64_t n;
  void* copy_out;      // [n] of copy_out_dtype, or nullptr
  CopyOut copy_out_dtype;
};

struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;          // 1 for the first step
  bool bias_correction;
  bool adamw_mode;       // true: decoupled decay (AdamW); false: L2 added to the gradient (Adam)
};

// Returns nullptr on success, else a static error message (nothing was written).
const char* adam_step(const AdamShard& shard, const AdamHyper& hyper, int num_threads,
                      SimdPath path);

}  // namespace zengine
