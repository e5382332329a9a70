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

// How a bf16 master takes its updated fp32 value (cpu_adam_bf16.cpp).
enum class Rounding : int {
  kNearest = 0,     // round to nearest even
  kKahan = 1,       // the master is the pair (param + compensation), both bf16
  kStochastic = 2,  // up with probability (dropped bits) / 2^16, from a counter-based hash
};

// Adam / AdamW over one bf16 master shard (bf16_master_weights_and_grads): bf16 gradient,
// moments in bf16 (bf16_optimizer_states) or fp32, the arithmetic in fp32.
struct AdamBf16Shard {
  uint16_t* param;          // [n] bf16, updated in place
  const uint16_t* grad;     // [n] bf16
  void* exp_avg;            // [n] bf16 or fp32 (states_bf16)
  void* exp_avg_sq;         // [n] bf16 or fp32
  uint16_t* compensation;   // [n] bf16 (kKahan), else nullptr
  int64_t n;
  bool states_bf16;
  Rounding rounding;
  uint32_t key;             // kStochastic: this step's key (mixed with each element's index)
  uint32_t first_index;     // kStochastic: the index of element 0 in the hashed sequence
  bool master_fp16;         // param and grad are fp16 (fp16_master_weights_and_grads): fp32
                            // moments, kNearest only
};

const char* adam_step_bf16(const AdamBf16Shard& shard, const AdamHyper& hyper, int num_threads,
                           SimdPath path);

}  // namespace zengine
