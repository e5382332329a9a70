// The Adam / AdamW per-step constants and their vector broadcasts, shared by the fp32 kernel
// (cpu_adam.cpp) and the bf16-master kernel (cpu_adam_bf16.cpp).
#pragma once

#include <cmath>

#include "cpu_adam.h"
#include "simd.h"

namespace zengine {
namespace adam_detail {

// The per-step constants, rounded to fp32 once.
struct AdamCoeffs {
  float one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bc2, eps;
  float l2_decay;      // weight_decay; used in L2 mode only
  float param_scale;   // 1 - lr * weight_decay; used in decoupled mode only
  float neg_step_size;
  bool use_l2, use_decoupled;
  bool stream_copy_out;  // write copy_out with streaming (cache-bypassing) stores
};

inline AdamCoeffs make_coeffs(const AdamHyper& h) {
  const double t = static_cast<double>(h.step);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
  AdamCoeffs c;
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  c.use_l2 = !h.adamw_mode && h.weight_decay != 0.0;
  c.use_decoupled = h.adamw_mode && h.weight_decay != 0.0;
  c.l2_decay = static_cast<float>(h.weight_decay);
  c.param_scale = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.neg_step_size = static_cast<float>(-(h.lr / bc1));
  c.stream_copy_out = false;
  return c;
}

// The constants broadcast to one vector of V.
template <class V>
struct Lanes {
  typename V::F one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bc2, eps, l2_decay, param_scale,
      neg_step_size;
  explicit Lanes(const AdamCoeffs& c)
      : one_minus_beta1(V::set1(c.one_minus_beta1)),
        beta2(V::set1(c.beta2)),
        one_minus_beta2(V::set1(c.one_minus_beta2)),
        inv_sqrt_bc2(V::set1(c.inv_sqrt_bc2)),
        eps(V::set1(c.eps)),
        l2_decay(V::set1(c.l2_decay)),
        param_scale(V::set1(c.param_scale)),
        neg_step_size(V::set1(c.neg_step_size)) {}
};

}  // namespace adam_detail
}  // namespace zengine
