// Blockwise int8 / int4 quantize and dequantize (see quantize.h for the format and rounding).
//
// Each block is read twice: once for its largest magnitude, once to divide, round and store;
// the second read hits L1 (a block is 1 KiB of fp32 at the default 256), so memory sees one
// read of the input and one write of the codes. int4 codes are made as int8 codes in a small
// stack buffer and then packed two per byte (and unpacked the same way), which keeps the
// vector code to int8 conversions only.
#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.h"

namespace zengine {
namespace {

constexpr int64_t kChunk = 64;  // int4 staging (and row-sum accumulator) length, in elements
// Read one page ahead: the hardware prefetcher stops at page ends, and without this the block's
// arithmetic and its memory reads serialize (measured: 48 -> 25 ms for 64M fp32 on 2 cores).
constexpr int64_t kPrefetchBytes = 4096;

inline int64_t elem_size(FloatType type) { return type == FloatType::kFp32 ? 4 : 2; }

// fp16 -> fp32, exact: normals re-biased, subnormals scaled (man * 2^-24 is exact in fp32).
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else {
    const float magnitude = static_cast<float>(man) * 5.9604644775390625e-8f;  // 2^-24
    std::memcpy(&bits, &magnitude, sizeof(bits));
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void pack_int4(const int8_t* codes, int64_t len, uint8_t* dst) {
  for (int64_t j = 0; j < len / 2; ++j) {
    dst[j] = static_cast<uint8_t>((codes[2 * j] + 8) | ((codes[2 * j + 1] + 8) << 4));
  }
}

inline void unpack_int4(const uint8_t* src, int64_t bytes, int8_t* codes) {
  for (int64_t j = 0; j < bytes; ++j) {
    codes[2 * j] = static_cast<int8_t>((src[j] & 0xF) - 8);
    codes[2 * j + 1] = static_cast<int8_t>((src[j] >> 4) - 8);
  }
}

// Per-path helpers beyond simd.h's: typed loads, the magnitude-bits max, the int8 conversions.
// Every path clamps with MAXPS/MINPS semantics (the second operand when either is NaN), so a
// NaN quotient becomes -qmax everywhere; its block's scale is NaN anyway.
template <class V>
struct Q;

template <>
struct Q<simd::Scalar> {
  using F = float;
  using M = uint32_t;
  template <FloatType T>
  static inline F load(const char* p, int64_t i) {
    if constexpr (T == FloatType::kFp32) {
      return reinterpret_cast<const float*>(p)[i];
    } else {
      const uint16_t h = reinterpret_cast<const uint16_t*>(p)[i];
      if constexpr (T == FloatType::kFp16) return fp16_to_float(h);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float out;
      std::memcpy(&out, &bits, sizeof(out));
      return out;
    }
  }
  static inline M max_zero() { return 0; }
  static inline M max_acc(M m, F x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    bits &= 0x7FFFFFFFu;  // magnitudes order as their bit patterns; NaN above inf
    return bits > m ? bits : m;
  }
  static inline uint32_t max_reduce(M m) { return m; }
  static inline void quantize_store(int8_t* dst, F x, F safe, F qmax) {
    F y = std::nearbyint(x / safe);  // the default rounding mode: half to even, as torch.round
    y = y > -qmax ? y : -qmax;
    y = y < qmax ? y : qmax;
    *dst = static_cast<int8_t>(static_cast<int>(y));
  }
  static inline F load_codes(const int8_t* p) { return static_cast<float>(*p); }
  static inline void pack_chunk(const int8_t* codes, uint8_t* dst) { pack_int4(codes, kChunk, dst); }
  static inline void unpack_chunk(const uint8_t* src, int8_t* codes) { unpack_int4(src, kChunk / 2, codes); }
};

#if ZE_X86
template <>
struct Q<simd::Avx2> {
  using F = __m256;
  using M = __m256i;
  template <FloatType T>
  ZE_TARGET_AVX2 static inline F load(const char* p, int64_t i) {
    if constexpr (T == FloatType::kFp32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i);
    } else {
      const auto* halves = reinterpret_cast<const uint16_t*>(p) + i;
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves));
      if constexpr (T == FloatType::kFp16) return _mm256_cvtph_ps(h);
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  ZE_TARGET_AVX2 static inline M max_zero() { return _mm256_setzero_si256(); }
  ZE_TARGET_AVX2 static inline M max_acc(M m, F x) {
    return _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF)));
  }
  ZE_TARGET_AVX2 static inline uint32_t max_reduce(M m) {
    __m128i v = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    v = _mm_max_epu32(v, _mm_shuffle_epi32(v, 0x4E));
    v = _mm_max_epu32(v, _mm_shuffle_epi32(v, 0xB1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(v));
  }
  ZE_TARGET_AVX2 static inline void quantize_store(int8_t* dst, F x, F safe, F qmax) {
    F y = _mm256_round_ps(_mm256_div_ps(x, safe), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_sub_ps(_mm256_setzero_ps(), qmax)), qmax);
    const __m256i ints = _mm256_cvtps_epi32(y);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packs_epi16(words, words));
  }
  ZE_TARGET_AVX2 static inline F load_codes(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // 64 int8 codes -> 32 bytes. In a 16-bit lane (c0 | c1 << 8) the two nibbles are gathered into
  // the low byte; XOR with 8 adds 8 modulo 16, which is exact for codes in [-8, 7].
  ZE_TARGET_AVX2 static inline void pack_chunk(const int8_t* codes, uint8_t* dst) {
    const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x00F0);
    const __m256i bias = _mm256_set1_epi16(0x0088);
    __m256i packed[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * h));
      packed[h] = _mm256_xor_si256(
          _mm256_or_si256(_mm256_and_si256(w, low), _mm256_and_si256(_mm256_srli_epi16(w, 4), high)), bias);
    }
    // packus works within 128-bit lanes: the 64-bit quarters come out in order 0, 2, 1, 3
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(packed[0], packed[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bytes);
  }
  // 32 bytes -> 64 int8 codes: each byte widened to a 16-bit lane, its high nibble moved to the
  // lane's high byte, then 8 taken from every byte.
  ZE_TARGET_AVX2 static inline void unpack_chunk(const uint8_t* src, int8_t* codes) {
    for (int h = 0; h < 2; ++h) {
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * h)));
      const __m256i w = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16(0x000F)),
                                        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x00F0)), 4));
      const __m256i values = _mm256_sub_epi8(w, _mm256_set1_epi8(8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * h), values);
    }
  }
};

template <>
struct Q<simd::Avx512> {
  using F = __m512;
  using M = __m512i;
  template <FloatType T>
  ZE_TARGET_AVX512 static inline F load(const char* p, int64_t i) {
    if constexpr (T == FloatType::kFp32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i);
    } else {
      const auto* halves = reinterpret_cast<const uint16_t*>(p) + i;
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves));
      if constexpr (T == FloatType::kFp16) return _mm512_cvtph_ps(h);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
  ZE_TARGET_AVX512 static inline M max_zero() { return _mm512_setzero_si512(); }
  ZE_TARGET_AVX512 static inline M max_acc(M m, F x) {
    return _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  ZE_TARGET_AVX512 static inline uint32_t max_reduce(M m) { return _mm512_reduce_max_epu32(m); }
  ZE_TARGET_AVX512 static inline void quantize_store(int8_t* dst, F x, F safe, F qmax) {
    F y = _mm512_roundscale_ps(_mm512_div_ps(x, safe), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    y = _mm512_min_ps(_mm512_max_ps(y, _mm512_sub_ps(_mm512_setzero_ps(), qmax)), qmax);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(y)));
  }
  ZE_TARGET_AVX512 static inline F load_codes(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // Byte shuffles need AVX-512BW at this width; AVX2's (part of this path's target) do it.
  ZE_TARGET_AVX512 static inline void pack_chunk(const int8_t* codes, uint8_t* dst) {
    Q<simd::Avx2>::pack_chunk(codes, dst);
  }
  ZE_TARGET_AVX512 static inline void unpack_chunk(const uint8_t* src, int8_t* codes) {
    Q<simd::Avx2>::unpack_chunk(src, codes);
  }
};
#endif  // ZE_X86

// Stores v's lanes at out[i...] as the output type (bf16/fp16 rounded to nearest even).
template <class V, FloatType T>
inline void store_out(char* out, int64_t i, typename V::F v) {
  if constexpr (T == FloatType::kFp32) {
    V::store(reinterpret_cast<float*>(out) + i, v);
  } else if constexpr (T == FloatType::kBf16) {
    V::store_half(reinterpret_cast<uint16_t*>(out) + i, V::to_bf16(v));
  } else {
    V::store_half(reinterpret_cast<uint16_t*>(out) + i, V::to_fp16(v));
  }
}

template <class V, FloatType T>
inline void quantize_span(const char* x, int64_t count, float safe, float qmax, int8_t* dst) {
  using QV = Q<V>;
  using QS = Q<simd::Scalar>;
  const auto vsafe = V::set1(safe), vqmax = V::set1(qmax);
  int64_t i = 0;
  for (; i + V::kWidth <= count; i += V::kWidth) {
    QV::quantize_store(dst + i, QV::template load<T>(x, i), vsafe, vqmax);
  }
  for (; i < count; ++i) QS::quantize_store(dst + i, QS::template load<T>(x, i), safe, qmax);
}

// One block: `valid` input elements at x, `block` codes (padding included) at dst.
template <class V, FloatType T>
inline void quantize_block(const char* x, int64_t valid, int64_t block, int bits, char* dst,
                           float* scale_out) {
  using QV = Q<V>;
  using QS = Q<simd::Scalar>;
  auto m = QV::max_zero();
  int64_t i = 0;
  for (; i + V::kWidth <= valid; i += V::kWidth) {
    if ((i * elem_size(T)) % 64 == 0) simd::prefetch_read(x + i * elem_size(T) + kPrefetchBytes);
    m = QV::max_acc(m, QV::template load<T>(x, i));
  }
  uint32_t max_bits = QV::max_reduce(m);
  for (; i < valid; ++i) max_bits = QS::max_acc(max_bits, QS::template load<T>(x, i));
  float absmax;
  std::memcpy(&absmax, &max_bits, sizeof(absmax));
  const float qmax = bits == 8 ? 127.0f : 7.0f;
  const float scale = absmax / qmax;  // a division, as the fallback's div_: not a multiply by 1/qmax
  *scale_out = scale;
  const float safe = scale > 0.0f ? scale : 1.0f;
  if (bits == 8) {
    quantize_span<V, T>(x, valid, safe, qmax, reinterpret_cast<int8_t*>(dst));
    std::memset(dst + valid, 0, static_cast<size_t>(block - valid));
    return;
  }
  int8_t codes[kChunk];
  for (int64_t c = 0; c < block; c += kChunk) {
    const int64_t len = std::min(kChunk, block - c);  // even: blocks are
    const int64_t count = std::max<int64_t>(0, std::min(len, valid - c));
    quantize_span<V, T>(x + c * elem_size(T), count, safe, qmax, codes);
    std::memset(codes + count, 0, static_cast<size_t>(len - count));
    uint8_t* packed = reinterpret_cast<uint8_t*>(dst) + c / 2;
    len == kChunk ? QV::pack_chunk(codes, packed) : pack_int4(codes, len, packed);
  }
}

// The decoded values of `count` codes (count <= kChunk for int4) as the output type at out.
template <class V, FloatType T>
inline void dequantize_span(const int8_t* codes, int64_t count, float scale, char* out) {
  const auto vscale = V::set1(scale);
  int64_t i = 0;
  for (; i + V::kWidth <= count; i += V::kWidth) {
    store_out<V, T>(out, i, V::mul(Q<V>::load_codes(codes + i), vscale));
  }
  for (; i < count; ++i) store_out<simd::Scalar, T>(out, i, static_cast<float>(codes[i]) * scale);
}

// Codes [c, c + count) of a row as int8 (int4: unpacked into buf; c is even, and `whole` says
// that a full chunk of codes lies inside the block from c, so reading all of it stays in bounds).
template <class V>
inline const int8_t* codes_at(const char* row, int bits, int64_t c, int64_t count, bool whole, int8_t* buf) {
  if (bits == 8) return reinterpret_cast<const int8_t*>(row) + c;
  const uint8_t* packed = reinterpret_cast<const uint8_t*>(row) + c / 2;
  whole ? Q<V>::unpack_chunk(packed, buf) : unpack_int4(packed, (count + 1) / 2, buf);
  return buf;
}

struct QuantArgs {
  const char* x;
  FloatType type;
  int64_t x_stride;
  QuantLayout layout;
  char* codes;
  float* scales;
  int64_t blocks;
};

struct DequantArgs {
  const char* codes;
  const float* scales;
  QuantLayout layout;
  char* out;
  FloatType type;
  int64_t out_stride;
  int64_t blocks;
};

// Units are (row, block) pairs, row-major.
template <class V, FloatType T>
void quantize_units_t(const QuantArgs& a, int64_t begin, int64_t end) {
  const QuantLayout& l = a.layout;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t row = u / a.blocks, b = u % a.blocks, start = b * l.block;
    quantize_block<V, T>(a.x + (row * a.x_stride + start) * elem_size(T), std::min(l.block, l.n - start),
                         l.block, l.bits, a.codes + row * l.code_stride + start * l.bits / 8,
                         a.scales + row * l.scale_stride + b);
  }
}

template <class V, FloatType T>
void dequantize_units_t(const DequantArgs& a, int64_t begin, int64_t end) {
  const QuantLayout& l = a.layout;
  int8_t buf[kChunk];
  for (int64_t u = begin; u < end; ++u) {
    const int64_t row = u / a.blocks, b = u % a.blocks, start = b * l.block;
    const int64_t valid = std::min(l.block, l.n - start);
    const char* codes = a.codes + row * l.code_stride;
    const float scale = a.scales[row * l.scale_stride + b];
    char* out = a.out + (row * a.out_stride + start) * elem_size(T);
    const int64_t step = l.bits == 8 ? valid : kChunk;
    for (int64_t c = 0; c < valid; c += step) {
      const int64_t count = std::min(step, valid - c);
      const int8_t* at = codes_at<V>(codes, l.bits, start + c, count, c + kChunk <= l.block, buf);
      dequantize_span<V, T>(at, count, scale, out + c * elem_size(T));
    }
  }
}

// Units are blocks of columns; every row's codes of the block are added in row order.
template <class V, FloatType T>
void dequantize_sum_units_t(const DequantArgs& a, int64_t begin, int64_t end) {
  const QuantLayout& l = a.layout;
  alignas(64) float acc[kChunk];
  int8_t buf[kChunk];
  for (int64_t b = begin; b < end; ++b) {
    const int64_t start = b * l.block, valid = std::min(l.block, l.n - start);
    for (int64_t c = start; c < start + valid; c += kChunk) {
      const int64_t count = std::min(kChunk, start + valid - c);
      for (int64_t row = 0; row < l.rows; ++row) {
        const bool whole = c + kChunk <= start + l.block;
        const int8_t* codes = codes_at<V>(a.codes + row * l.code_stride, l.bits, c, count, whole, buf);
        const float scale = a.scales[row * l.scale_stride + b];
        const auto vscale = V::set1(scale);
        int64_t i = 0;
        for (; i + V::kWidth <= count; i += V::kWidth) {
          const auto v = V::mul(Q<V>::load_codes(codes + i), vscale);
          V::store(acc + i, row == 0 ? v : V::add(V::load(acc + i), v));
        }
        for (; i < count; ++i) {
          const float v = static_cast<float>(codes[i]) * scale;
          acc[i] = row == 0 ? v : acc[i] + v;
        }
      }
      char* out = a.out + c * elem_size(T);
      int64_t i = 0;
      for (; i + V::kWidth <= count; i += V::kWidth) store_out<V, T>(out, i, V::load(acc + i));
      for (; i < count; ++i) store_out<simd::Scalar, T>(out, i, acc[i]);
    }
  }
}

// One switch on the float type per range of units, outside the element loops.
#define ZE_BY_TYPE(fn, V, type, ...)                                                  \
  switch (type) {                                                                    \
    case FloatType::kFp32: return fn<V, FloatType::kFp32>(__VA_ARGS__);              \
    case FloatType::kBf16: return fn<V, FloatType::kBf16>(__VA_ARGS__);              \
    case FloatType::kFp16: return fn<V, FloatType::kFp16>(__VA_ARGS__);              \
  }

template <class V>
inline void quantize_units(const QuantArgs& a, int64_t b, int64_t e) {
  ZE_BY_TYPE(quantize_units_t, V, a.type, a, b, e)
}
template <class V>
inline void dequantize_units(const DequantArgs& a, int64_t b, int64_t e) {
  ZE_BY_TYPE(dequantize_units_t, V, a.type, a, b, e)
}
template <class V>
inline void dequantize_sum_units(const DequantArgs& a, int64_t b, int64_t e) {
  ZE_BY_TYPE(dequantize_sum_units_t, V, a.type, a, b, e)
}

// One function per instruction set and entry point, so one build serves every x86 CPU.
using QuantFn = void (*)(const QuantArgs&, int64_t, int64_t);
using DequantFn = void (*)(const DequantArgs&, int64_t, int64_t);

void quantize_scalar(const QuantArgs& a, int64_t b, int64_t e) { quantize_units<simd::Scalar>(a, b, e); }
void dequantize_scalar(const DequantArgs& a, int64_t b, int64_t e) {
  dequantize_units<simd::Scalar>(a, b, e);
}
void dequantize_sum_scalar(const DequantArgs& a, int64_t b, int64_t e) {
  dequantize_sum_units<simd::Scalar>(a, b, e);
}
#if ZE_X86
ZE_TARGET_AVX2 __attribute__((flatten)) void quantize_avx2(const QuantArgs& a, int64_t b, int64_t e) {
  quantize_units<simd::Avx2>(a, b, e);
}
ZE_TARGET_AVX2 __attribute__((flatten)) void dequantize_avx2(const DequantArgs& a, int64_t b, int64_t e) {
  dequantize_units<simd::Avx2>(a, b, e);
}
ZE_TARGET_AVX2 __attribute__((flatten)) void dequantize_sum_avx2(const DequantArgs& a, int64_t b, int64_t e) {
  dequantize_sum_units<simd::Avx2>(a, b, e);
}
ZE_TARGET_AVX512 __attribute__((flatten)) void quantize_avx512(const QuantArgs& a, int64_t b, int64_t e) {
  quantize_units<simd::Avx512>(a, b, e);
}
ZE_TARGET_AVX512 __attribute__((flatten)) void dequantize_avx512(const DequantArgs& a, int64_t b, int64_t e) {
  dequantize_units<simd::Avx512>(a, b, e);
}
ZE_TARGET_AVX512 __attribute__((flatten)) void dequantize_sum_avx512(const DequantArgs& a, int64_t b,
                                                                     int64_t e) {
  dequantize_sum_units<simd::Avx512>(a, b, e);
}
#endif

const char* check_layout(const QuantLayout& l) {
  if (l.rows < 0 || l.n < 0 || l.block <= 0) return "quantize: rows, n and block must be >= 0, > 0";
  if (l.bits != 8 && l.bits != 4) return "quantize: bits must be 8 or 4";
  if (l.bits == 4 && l.block % 2 != 0) return "quantize: int4 needs an even block";
  const int64_t blocks = (l.n + l.block - 1) / l.block;
  if (l.rows > 1 && (l.code_stride < blocks * l.block * l.bits / 8 || l.scale_stride < blocks)) {
    return "quantize: a row stride is shorter than a row";
  }
  return nullptr;
}

// Work per parallel chunk: about kBlockElems elements, whole quantization blocks.
int64_t units_per_chunk(int64_t elems_per_unit) { return std::max<int64_t>(1, kBlockElems / elems_per_unit); }

}  // namespace

const char* quantize_blocks(const void* x, FloatType type, int64_t x_stride, const QuantLayout& layout,
                            void* codes, float* scales, int num_threads, SimdPath path) {
  if (const char* err = check_layout(layout)) return err;
  if (layout.rows > 1 && x_stride < layout.n) return "quantize: the input's row stride is shorter than a row";
  SimdPath resolved;
  if (const char* err = resolve_simd_path(path, &resolved)) return err;
  QuantFn fn = quantize_scalar;
#if ZE_X86
  if (resolved == SimdPath::kAvx512) fn = quantize_avx512;
  if (resolved == SimdPath::kAvx2) fn = quantize_avx2;
#endif
  const int64_t blocks = (layout.n + layout.block - 1) / layout.block;
  const QuantArgs args{static_cast<const char*>(x), type, x_stride, layout, static_cast<char*>(codes), scales,
                       blocks};
  parallel_blocks(layout.rows * blocks, units_per_chunk(layout.block), num_threads,
                  [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return nullptr;
}

const char* dequantize_blocks(const void* codes, const float* scales, const QuantLayout& layout, void* out,
                              FloatType type, int64_t out_stride, bool sum_rows, int num_threads,
                              SimdPath path) {
  if (const char* err = check_layout(layout)) return err;
  if (!sum_rows && layout.rows > 1 && out_stride < layout.n) {
    return "dequantize: the output's row stride is shorter than a row";
  }
  SimdPath resolved;
  if (const char* err = resolve_simd_path(path, &resolved)) return err;
  DequantFn fn = sum_rows ? dequantize_sum_scalar : dequantize_scalar;
#if ZE_X86
  if (resolved == SimdPath::kAvx512) fn = sum_rows ? dequantize_sum_avx512 : dequantize_avx512;
  if (resolved == SimdPath::kAvx2) fn = sum_rows ? dequantize_sum_avx2 : dequantize_avx2;
#endif
  const int64_t blocks = (layout.n + layout.block - 1) / layout.block;
  const DequantArgs args{static_cast<const char*>(codes), scales, layout, static_cast<char*>(out), type,
                         out_stride, blocks};
  if (sum_rows) {
    if (layout.rows == 0) return "dequantize: a sum needs at least one row";
    parallel_blocks(blocks, units_per_chunk(layout.block * layout.rows), num_threads,
                    [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  } else {
    parallel_blocks(layout.rows * blocks, units_per_chunk(layout.block), num_threads,
                    [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  }
  return nullptr;
}

}  // namespace zengine
