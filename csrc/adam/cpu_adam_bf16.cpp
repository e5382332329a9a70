// Adam / AdamW over a bf16 master shard: DeepSpeed's bf16_master_weights_and_grads (with
// bf16_optimizer_states: bf16 moments), written once over the simd.h helpers; an fp16 master
// (fp16_master_weights_and_grads: fp32 moments, nearest) is the same lanes with fp16 loads/stores.
//
// Per element: load the master (kKahan: param + compensation, in fp32), the bf16 gradient and
// the moments as fp32; then cpu_adam.cpp's update, the same fp32 operations in the same order;
// then store the moments (bf16: round to nearest even) and the master by its Rounding:
//   kNearest     param = rne(p)
//   kKahan       param = rne(p); compensation = rne(p - param)   (the pair carries ~16 bits more)
//   kStochastic  param = (bits(p) + mix32(key ^ (first_index + i)) % 2^16) >> 16
// zengine/ops/adam_bf16.py repeats these steps with torch ops for the fallback path.
#include <cmath>

#include "adam_math.h"
#include "cpu_adam.h"
#include "simd.h"

namespace zengine {
namespace {

using adam_detail::AdamCoeffs;
using adam_detail::Lanes;
using adam_detail::make_coeffs;

// A moment as stored: bf16 (rounded to nearest) or fp32.
template <class V, bool kBf16>
inline typename V::F load_state(const void* base, int64_t i) {
  if constexpr (kBf16) return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  return V::load(static_cast<const float*>(base) + i);
}

template <class V, bool kBf16>
inline void store_state(void* base, int64_t i, typename V::F x) {
  if constexpr (kBf16) {
    V::store_half(static_cast<uint16_t*>(base) + i, V::to_bf16(x));
  } else {
    V::store(static_cast<float*>(base) + i, x);
  }
}

// A master or gradient element: bf16, or fp16 (kFp16: fp16_master_weights_and_grads).
template <class V, bool kFp16>
inline typename V::F load_master(const uint16_t* p) {
  if constexpr (kFp16) return V::load_fp16(p);
  return V::load_bf16(p);
}

// Updates V::kWidth elements starting at i.
template <class V, bool kStatesBf16, Rounding kRound, bool kFp16 = false>
inline void adam_bf16_lanes(const AdamBf16Shard& s, const AdamCoeffs& c, const Lanes<V>& k,
                            int64_t i) {
  auto p = load_master<V, kFp16>(s.param + i);
  if constexpr (kRound == Rounding::kKahan) p = V::add(p, V::load_bf16(s.compensation + i));
  auto g = load_master<V, kFp16>(s.grad + i);
  if (c.use_l2) g = V::add(g, V::mul(k.l2_decay, p));
  auto m = load_state<V, kStatesBf16>(s.exp_avg, i);
  auto v = load_state<V, kStatesBf16>(s.exp_avg_sq, i);
  m = V::add(m, V::mul(k.one_minus_beta1, V::sub(g, m)));
  v = V::add(V::mul(k.beta2, v), V::mul(k.one_minus_beta2, V::mul(g, g)));
  const auto denom = V::add(V::mul(V::sqrt(v), k.inv_sqrt_bc2), k.eps);
  if (c.use_decoupled) p = V::mul(p, k.param_scale);
  p = V::add(p, V::mul(k.neg_step_size, V::div(m, denom)));
  store_state<V, kStatesBf16>(s.exp_avg, i, m);
  store_state<V, kStatesBf16>(s.exp_avg_sq, i, v);
  if constexpr (kRound == Rounding::kStochastic) {
    const auto first = static_cast<uint32_t>(static_cast<int64_t>(s.first_index) + i);
    V::store_half(s.param + i, V::to_bf16_stochastic(p, s.key, first));
  } else if constexpr (kFp16) {
    V::store_half(s.param + i, V::to_fp16(p));  // round to nearest even
  } else {
    const auto kept = V::to_bf16(p);
    V::store_half(s.param + i, kept);
    if constexpr (kRound == Rounding::kKahan) {
      // p - kept is exact in fp32 (kept is p rounded): only its bf16 rounding is lost
      const auto lost = V::sub(p, V::load_bf16(s.param + i));
      V::store_half(s.compensation + i, V::to_bf16(lost));
    }
  }
}

template <class V, bool kStatesBf16, Rounding kRound, bool kFp16 = false>
inline void adam_bf16_range_as(const AdamBf16Shard& s, const AdamCoeffs& c, int64_t begin,
                               int64_t end) {
  const Lanes<V> vec(c);
  const Lanes<simd::Scalar> one(c);
  int64_t i = begin;
  for (; i + V::kWidth <= end; i += V::kWidth) {
    adam_bf16_lanes<V, kStatesBf16, kRound, kFp16>(s, c, vec, i);
  }
  for (; i < end; ++i) adam_bf16_lanes<simd::Scalar, kStatesBf16, kRound, kFp16>(s, c, one, i);
}

template <class V, bool kStatesBf16>
inline void adam_bf16_range_states(const AdamBf16Shard& s, const AdamCoeffs& c, int64_t begin,
                                   int64_t end) {
  switch (s.rounding) {
    case Rounding::kNearest:
      return adam_bf16_range_as<V, kStatesBf16, Rounding::kNearest>(s, c, begin, end);
    case Rounding::kKahan:
      return adam_bf16_range_as<V, kStatesBf16, Rounding::kKahan>(s, c, begin, end);
    case Rounding::kStochastic:
      return adam_bf16_range_as<V, kStatesBf16, Rounding::kStochastic>(s, c, begin, end);
  }
}

template <class V>
inline void adam_bf16_range(const AdamBf16Shard& s, const AdamCoeffs& c, int64_t begin,
                            int64_t end) {
  if (s.master_fp16) {
    return adam_bf16_range_as<V, false, Rounding::kNearest, true>(s, c, begin, end);
  }
  if (s.states_bf16) return adam_bf16_range_states<V, true>(s, c, begin, end);
  adam_bf16_range_states<V, false>(s, c, begin, end);
}

using RangeFn = void (*)(const AdamBf16Shard&, const AdamCoeffs&, int64_t, int64_t);

void adam_bf16_range_scalar(const AdamBf16Shard& s, const AdamCoeffs& c, int64_t begin,
                            int64_t end) {
  adam_bf16_range<simd::Scalar>(s, c, begin, end);
}

#if ZE_X86
ZE_TARGET_AVX2 __attribute__((flatten)) void adam_bf16_range_avx2(const AdamBf16Shard& s,
                                                                  const AdamCoeffs& c,
                                                                  int64_t begin, int64_t end) {
  adam_bf16_range<simd::Avx2>(s, c, begin, end);
}

ZE_TARGET_AVX512 __attribute__((flatten)) void adam_bf16_range_avx512(const AdamBf16Shard& s,
                                                                      const AdamCoeffs& c,
                                                                      int64_t begin,
                                                                      int64_t end) {
  adam_bf16_range<simd::Avx512>(s, c, begin, end);
}
#endif

RangeFn range_fn(SimdPath path) {
#if ZE_X86
  if (path == SimdPath::kAvx512) return adam_bf16_range_avx512;
  if (path == SimdPath::kAvx2) return adam_bf16_range_avx2;
#endif
  return adam_bf16_range_scalar;
}

}  // namespace

const char* adam_step_bf16(const AdamBf16Shard& shard, const AdamHyper& hyper, int num_threads,
                           SimdPath path) {
  SimdPath resolved;
  if (const char* err = resolve_simd_path(path, &resolved)) return err;
  if (shard.master_fp16 && (shard.states_bf16 || shard.rounding != Rounding::kNearest)) {
    return "an fp16 master keeps fp32 moments and rounds to nearest";
  }
  if (shard.rounding == Rounding::kKahan && shard.compensation == nullptr) {
    return "Kahan rounding needs a compensation buffer";
  }
  const AdamCoeffs coeffs = make_coeffs(hyper);
  const RangeFn range = range_fn(resolved);
  parallel_blocks(shard.n, kBlockElems, num_threads,
                  [&](int64_t, int64_t begin, int64_t end) { range(shard, coeffs, begin, end); });
  return nullptr;
}

}  // namespace zengine
