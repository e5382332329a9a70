// Vector-width helpers for the CPU kernels: one struct per instruction set, same member names.
//
// A kernel is written once as a template over one of these structs (`V::load`, `V::add`, ...)
// and instantiated per instruction set inside a function that carries that set's target
// attribute (ZE_TARGET_AVX2, ZE_TARGET_AVX512) plus `flatten`, so one build serves every x86
// CPU and the run-time dispatcher (dispatch.h) picks the widest path the CPU has.
//
// `Scalar` is the reference: the vector structs perform the same IEEE single-precision
// operations lane by lane (no FMA contraction: builds use -ffp-contract=off), so every path
// gives bit-identical float results. Reductions into double differ only in summation order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#define ZE_X86 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers trip its own -Wmaybe-uninitialized (the _mm512_undefined_* idiom).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#else
#define ZE_X86 0
#endif

namespace zengine {
namespace simd {

// fp32 -> bf16, round to nearest even; any NaN becomes the quiet NaN 0x7FC0 (rounding its
// bits could otherwise carry a NaN into infinity).
inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// bf16 bits -> fp32 (exact).
// IEEE fp16 -> fp32, exact (every fp16 value, subnormals included, is an fp32 value).
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13) | (mant ? 0x00400000u : 0u);  // inf; NaN made quiet
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);  // rebias 15 -> 127
  } else {
    const float x = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    std::memcpy(&bits, &x, sizeof(bits));
    bits |= sign;
  }
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// The random bits of stochastic rounding: a 32-bit integer hash (Wellons' lowbias32) of the
// element's index mixed with a key. Counter-based, so every path and thread count draws the
// same bits for the same element, and zengine/ops/adam_bf16.py repeats it with torch ops.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// fp32 -> bf16, rounded stochastically: up with probability (dropped bits) / 2^16, by adding
// 16 random bits below the kept ones and truncating; NaN becomes the quiet NaN 0x7FC0.
inline uint16_t float_to_bf16_stochastic(float x, uint32_t random) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  if ((bits & 0x7FFFFFFFu) == 0x7F800000u) return static_cast<uint16_t>(bits >> 16);
  return static_cast<uint16_t>((bits + (random & 0xFFFFu)) >> 16);
}

// fp32 -> IEEE fp16, round to nearest even, overflow to infinity, subnormals kept; a NaN
// keeps its sign and top payload bits and is made quiet, as the F16C instruction does.
inline uint16_t float_to_fp16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return sign | 0x7E00 | ((mag >> 13) & 0x3FFu);
  if (mag == 0x7F800000u) return sign | 0x7C00;
  if (mag >= 0x477FF000u) return sign | 0x7C00;  // at or past the tie with 65520: rounds to inf
  if (mag >= 0x38800000u) {                      // normal in fp16: >= 2^-14
    // Re-bias the exponent (127 -> 15) and round away the 13 low mantissa bits to even.
    const uint32_t rounded = mag - 0x38000000u + 0xFFFu + ((mag >> 13) & 1u);
    return sign | static_cast<uint16_t>(rounded >> 13);
  }
  // Subnormal or zero in fp16 (units of 2^-24): adding 0.5f, whose ulp is 2^-24, lets the
  // FPU do the round-to-nearest-even; the integer difference of the bit patterns is the count.
  float magnitude;
  std::memcpy(&magnitude, &mag, sizeof(magnitude));
  const float shifted = magnitude + 0.5f;
  uint32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  return sign | static_cast<uint16_t>(shifted_bits - 0x3F000000u);
}

// Software prefetch of the cache line holding p (no-ops where the compiler lacks them).
inline void prefetch_read(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#endif
}
inline void prefetch_write(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 1, 3);
#endif
}

// One float at a time: the reference path, and the tail of the vector paths.
struct Scalar {
  using F = float;
  using Acc = double;  // sum-of-squares accumulator
  static constexpr int kWidth = 1;
  static constexpr const char* kName = "scalar";

  static inline F load(const float* p) { return *p; }
  static inline void store(float* p, F v) { *p = v; }
  static inline F set1(float x) { return x; }
  static inline F add(F a, F b) { return a + b; }
  static inline F sub(F a, F b) { return a - b; }
  static inline F mul(F a, F b) { return a * b; }
  static inline F div(F a, F b) { return a / b; }
  static inline F sqrt(F a) { return std::sqrt(a); }
  // 16-bit copies: convert, then store (or stream: bypass the cache, for large outputs).
  using H = uint16_t;
  static inline H to_bf16(F v) { return float_to_bf16(v); }
  static inline H to_fp16(F v) { return float_to_fp16(v); }
  static inline F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static inline F load_fp16(const uint16_t* p) { return fp16_to_float(*p); }
  // Stochastic rounding of lane j with the bits mix32(key ^ (first + j)).
  static inline H to_bf16_stochastic(F v, uint32_t key, uint32_t first) {
    return float_to_bf16_stochastic(v, mix32(key ^ first));
  }
  static inline void store_half(uint16_t* p, H h) { *p = h; }
  static inline void stream_half(uint16_t* p, H h) { *p = h; }
  static inline void stream(float* p, F v) { *p = v; }
  static inline void stream_fence() {}

  static inline Acc acc_zero() { return 0.0; }
  static inline Acc acc_squares(Acc acc, F x) {
    const double d = x;
    return acc + d * d;  // a float squared is exact in double
  }
  static inline double acc_sum(Acc acc) { return acc; }
};

#if ZE_X86

#define ZE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZE_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// Eight floats per __m256; F16C for fp16, integer AVX2 for bf16 rounding.
struct Avx2 {
  using F = __m256;
  struct Acc {
    __m256d lo, hi;
  };
  static constexpr int kWidth = 8;
  static constexpr const char* kName = "avx2";

  ZE_TARGET_AVX2 static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  ZE_TARGET_AVX2 static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  ZE_TARGET_AVX2 static inline F set1(float x) { return _mm256_set1_ps(x); }
  ZE_TARGET_AVX2 static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  ZE_TARGET_AVX2 static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  ZE_TARGET_AVX2 static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  ZE_TARGET_AVX2 static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  ZE_TARGET_AVX2 static inline F sqrt(F a) { return _mm256_sqrt_ps(a); }

  using H = __m128i;  // eight 16-bit values
  ZE_TARGET_AVX2 static inline H to_bf16(F v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    rounded = _mm256_srli_epi32(rounded, 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
    // Every lane is <= 0xFFFF, so the unsigned-saturating pack is exact.
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  }
  ZE_TARGET_AVX2 static inline H to_fp16(F v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  }
  ZE_TARGET_AVX2 static inline F load_fp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  ZE_TARGET_AVX2 static inline F load_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  ZE_TARGET_AVX2 static inline __m256i mix32(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  ZE_TARGET_AVX2 static inline H to_bf16_stochastic(F v, uint32_t key, uint32_t first) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), lanes);
    const __m256i random = mix32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(key)), index));
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    // infinities keep their bits (mag == 0x7F800000); NaNs become 0x7FC0 below
    const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), mag);
    const __m256i low = _mm256_and_si256(_mm256_and_si256(random, _mm256_set1_epi32(0xFFFF)), finite);
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, low), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  }
  ZE_TARGET_AVX2 static inline void store_half(uint16_t* p, H h) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  // Streaming stores need p aligned to the vector size (16 bytes here, 32 for floats).
  ZE_TARGET_AVX2 static inline void stream_half(uint16_t* p, H h) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
  }
  ZE_TARGET_AVX2 static inline void stream(float* p, F v) { _mm256_stream_ps(p, v); }
  ZE_TARGET_AVX2 static inline void stream_fence() { _mm_sfence(); }

  ZE_TARGET_AVX2 static inline Acc acc_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  ZE_TARGET_AVX2 static inline Acc acc_squares(Acc acc, F x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    return {_mm256_fmadd_pd(lo, lo, acc.lo), _mm256_fmadd_pd(hi, hi, acc.hi)};
  }
  ZE_TARGET_AVX2 static inline double acc_sum(Acc acc) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(acc.lo, acc.hi));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
};

// Sixteen floats per __m512; AVX-512F only (no BW/DQ/VL needed).
struct Avx512 {
  using F = __m512;
  struct Acc {
    __m512d lo, hi;
  };
  static constexpr int kWidth = 16;
  static constexpr const char* kName = "avx512";

  ZE_TARGET_AVX512 static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  ZE_TARGET_AVX512 static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  ZE_TARGET_AVX512 static inline F set1(float x) { return _mm512_set1_ps(x); }
  ZE_TARGET_AVX512 static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  ZE_TARGET_AVX512 static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  ZE_TARGET_AVX512 static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  ZE_TARGET_AVX512 static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  ZE_TARGET_AVX512 static inline F sqrt(F a) { return _mm512_sqrt_ps(a); }

  using H = __m256i;  // sixteen 16-bit values
  ZE_TARGET_AVX512 static inline H to_bf16(F v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    rounded = _mm512_srli_epi32(rounded, 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
  }
  ZE_TARGET_AVX512 static inline H to_fp16(F v) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  }
  ZE_TARGET_AVX512 static inline F load_fp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ZE_TARGET_AVX512 static inline F load_bf16(const uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  ZE_TARGET_AVX512 static inline __m512i mix32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  ZE_TARGET_AVX512 static inline H to_bf16_stochastic(F v, uint32_t key, uint32_t first) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)), lanes);
    const __m512i random = mix32(_mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(key)), index));
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    // infinities keep their bits; NaNs become 0x7FC0 below
    const __mmask16 finite = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x7F800000), mag);
    const __m512i low = _mm512_maskz_and_epi32(finite, random, _mm512_set1_epi32(0xFFFF));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, low), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
  }
  ZE_TARGET_AVX512 static inline void store_half(uint16_t* p, H h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  // Streaming stores need p aligned to the vector size (32 bytes here, 64 for floats).
  ZE_TARGET_AVX512 static inline void stream_half(uint16_t* p, H h) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
  }
  ZE_TARGET_AVX512 static inline void stream(float* p, F v) { _mm512_stream_ps(p, v); }
  ZE_TARGET_AVX512 static inline void stream_fence() { _mm_sfence(); }

  ZE_TARGET_AVX512 static inline Acc acc_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  ZE_TARGET_AVX512 static inline Acc acc_squares(Acc acc, F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512d lo = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_castsi512_si256(bits)));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(bits, 1)));
    return {_mm512_fmadd_pd(lo, lo, acc.lo), _mm512_fmadd_pd(hi, hi, acc.hi)};
  }
  ZE_TARGET_AVX512 static inline double acc_sum(Acc acc) {
    return _mm512_reduce_add_pd(_mm512_add_pd(acc.lo, acc.hi));
  }
};

#endif  // ZE_X86

}  // namespace simd
}  // namespace zengine
