// The Adam / AdamW update, written once over the simd.h helpers and instantiated per path.
//
// Per element, in fp32 and in this order (torch's AdamW math, with the bias corrections
// folded into two scalars computed in double once per step):
//   g  = grad                     (+ weight_decay * p   when L2 mode)
//   m  = m + (1 - beta1) * (g - m)
//   v  = beta2 * v + (1 - beta2) * (g * g)
//   d  = sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps
//   p  = p * (1 - lr * weight_decay)      (decoupled mode)
//   p  = p + (-lr / (1 - beta1^t)) * (m / d)
// and optionally p is also stored as fp32/bf16/fp16 in `copy_out`.
// zengine/ops/adam.py repeats these steps with torch ops for the fallback path.
#include "cpu_adam.h"

#include <cmath>

#include "adam_math.h"
#include "simd.h"

namespace zengine {
namespace {

using adam_detail::AdamCoeffs;
using adam_detail::Lanes;
using adam_detail::make_coeffs;

// Outputs at least this long are streamed: they would only evict the shard from the cache,
// and streaming skips the read-for-ownership of every output line (2 of 30 bytes per element
// for bf16). Shorter ones stay cached for whoever reads them next.
constexpr int64_t kStreamMinElems = int64_t{1} << 22;

constexpr int kLineElems = 16;            // floats per 64-byte cache line
constexpr int64_t kPrefetchElems = 192;   // 12 lines ahead: best measured on Zen3 (128-256)

// Updates V::kWidth elements starting at i.
template <class V, CopyOut kOut, bool kStream>
inline void adam_lanes(const AdamShard& s, const AdamCoeffs& c, const Lanes<V>& k, int64_t i) {
  auto p = V::load(s.param + i);
  auto g = V::load(s.grad + i);
  if (c.use_l2) g = V::add(g, V::mul(k.l2_decay, p));
  auto m = V::load(s.exp_avg + i);
  auto v = V::load(s.exp_avg_sq + i);
  m = V::add(m, V::mul(k.one_minus_beta1, V::sub(g, m)));
  v = V::add(V::mul(k.beta2, v), V::mul(k.one_minus_beta2, V::mul(g, g)));
  const auto denom = V::add(V::mul(V::sqrt(v), k.inv_sqrt_bc2), k.eps);
  if (c.use_decoupled) p = V::mul(p, k.param_scale);
  p = V::add(p, V::mul(k.neg_step_size, V::div(m, denom)));
  V::store(s.exp_avg + i, m);
  V::store(s.exp_avg_sq + i, v);
  V::store(s.param + i, p);
  if constexpr (kOut == CopyOut::kFloat32) {
    float* out = static_cast<float*>(s.copy_out) + i;
    kStream ? V::stream(out, p) : V::store(out, p);
  } else if constexpr (kOut != CopyOut::kNone) {
    uint16_t* out = static_cast<uint16_t*>(s.copy_out) + i;
    const auto half = kOut == CopyOut::kBFloat16 ? V::to_bf16(p) : V::to_fp16(p);
    kStream ? V::stream_half(out, half) : V::store_half(out, half);
  }
}

template <class V, CopyOut kOut, bool kStream>
inline void adam_range_as(const AdamShard& s, const AdamCoeffs& c, int64_t begin, int64_t end) {
  const Lanes<V> vec(c);
  const Lanes<simd::Scalar> one(c);
  int64_t i = begin;
  // One cache line (16 floats) of each stream per iteration, the lines kPrefetchElems ahead
  // requested now: the hardware prefetchers stop at every 4 KiB page, these do not.
  for (; i + kPrefetchElems + kLineElems <= end; i += kLineElems) {
    simd::prefetch_write(s.param + i + kPrefetchElems);
    simd::prefetch_read(s.grad + i + kPrefetchElems);
    simd::prefetch_write(s.exp_avg + i + kPrefetchElems);
    simd::prefetch_write(s.exp_avg_sq + i + kPrefetchElems);
    for (int j = 0; j < kLineElems; j += V::kWidth) adam_lanes<V, kOut, kStream>(s, c, vec, i + j);
  }
  for (; i + V::kWidth <= end; i += V::kWidth) adam_lanes<V, kOut, kStream>(s, c, vec, i);
  for (; i < end; ++i) adam_lanes<simd::Scalar, kOut, false>(s, c, one, i);
  if (kStream) V::stream_fence();  // order the streamed lines before the threads join
}

template <class V, CopyOut kOut>
inline void adam_range_to(const AdamShard& s, const AdamCoeffs& c, int64_t begin, int64_t end) {
  if (c.stream_copy_out) return adam_range_as<V, kOut, true>(s, c, begin, end);
  adam_range_as<V, kOut, false>(s, c, begin, end);
}

template <class V>
inline void adam_range(const AdamShard& s, const AdamCoeffs& c, int64_t begin, int64_t end) {
  switch (s.copy_out_dtype) {
    case CopyOut::kNone: return adam_range_as<V, CopyOut::kNone, false>(s, c, begin, end);
    case CopyOut::kFloat32: return adam_range_to<V, CopyOut::kFloat32>(s, c, begin, end);
    case CopyOut::kBFloat16: return adam_range_to<V, CopyOut::kBFloat16>(s, c, begin, end);
    case CopyOut::kFloat16: return adam_range_to<V, CopyOut::kFloat16>(s, c, begin, end);
  }
}

using RangeFn = void (*)(const AdamShard&, const AdamCoeffs&, int64_t, int64_t);

void adam_range_scalar(const AdamShard& s, const AdamCoeffs& c, int64_t begin, int64_t end) {
  adam_range<simd::Scalar>(s, c, begin, end);
}

#if ZE_X86
ZE_TARGET_AVX2 __attribute__((flatten)) void adam_range_avx2(const AdamShard& s,
                                                             const AdamCoeffs& c, int64_t begin,
                                                             int64_t end) {
  adam_range<simd::Avx2>(s, c, begin, end);
}

ZE_TARGET_AVX512 __attribute__((flatten)) void adam_range_avx512(const AdamShard& s,
                                                                 const AdamCoeffs& c,
                                                                 int64_t begin, int64_t end) {
  adam_range<simd::Avx512>(s, c, begin, end);
}
#endif

RangeFn range_fn(SimdPath path) {
#if ZE_X86
  if (path == SimdPath::kAvx512) return adam_range_avx512;
  if (path == SimdPath::kAvx2) return adam_range_avx2;
#endif
  return adam_range_scalar;
}

}  // namespace

const char* adam_step(const AdamShard& shard, const AdamHyper& hyper, int num_threads,
                      SimdPath path) {
  SimdPath resolved;
  if (const char* err = resolve_simd_path(path, &resolved)) return err;
  if (shard.copy_out_dtype != CopyOut::kNone && shard.copy_out == nullptr) {
    return "copy_out dtype given without a copy_out buffer";
  }
  AdamCoeffs coeffs = make_coeffs(hyper);
  // Streaming stores need the vector-aligned addresses that a 64-byte aligned base gives
  // (blocks start at multiples of kBlockElems).
  coeffs.stream_copy_out = shard.copy_out != nullptr && shard.n >= kStreamMinElems &&
                           reinterpret_cast<uintptr_t>(shard.copy_out) % 64 == 0;
  const RangeFn range = range_fn(resolved);
  parallel_blocks(shard.n, kBlockElems, num_threads,
                  [&](int64_t, int64_t begin, int64_t end) { range(shard, coeffs, begin, end); });
  return nullptr;
}

}  // namespace zengine
