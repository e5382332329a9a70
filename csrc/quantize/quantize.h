// Blockwise int8 / int4 quantization for ZeRO++'s quantized gathers and gradient reductions.
//
// A row of n floats is cut into blocks of `block` elements (the last one zero-padded); each
// block gets one fp32 scale = max|x| / qmax (qmax 127 for int8, 7 for int4) and its values
// become round(x / scale) (half to even; a zero scale divides by 1), clamped to [-qmax, qmax].
// int8 codes are stored as they are; int4 codes two per byte, element 2i in the low nibble,
// 2i+1 in the high one, each as code + 8 (so 0 is 0x8 and a byte never needs sign handling).
//
// These are the torch fallback's operations in its order (zengine/ops/quantize.py), one IEEE
// fp32 operation each, so every SIMD path and the fallback give the same bits on finite input.
// A block holding inf or NaN gets a non-finite scale (the max is taken on the magnitudes'
// bits, which orders NaN above inf), so all of it decodes non-finite, as in the fallback.
#pragma once

#include <cstdint>

#include "dispatch.h"

namespace zengine {

enum class FloatType : int { kFp32 = 0, kBf16 = 1, kFp16 = 2 };

// Shape of a quantized buffer: `rows` rows of n valid elements, blocks = ceil(n / block).
// Strides are in elements of each buffer's own type (bytes for codes: int4 rows hold
// blocks * block / 2 of them).
struct QuantLayout {
  int64_t rows;
  int64_t n;
  int64_t block;  // elements per scale; even for int4
  int bits;       // 8 or 4
  int64_t code_stride;   // bytes between rows of codes (>= blocks * block * bits / 8)
  int64_t scale_stride;  // floats between rows of scales (>= blocks)
};

// Quantizes x ([rows, x_stride] of `type`, first n columns) into codes and scales. Returns
// nullptr, or a static error message.
const char* quantize_blocks(const void* x, FloatType type, int64_t x_stride, const QuantLayout& layout,
                            void* codes, float* scales, int num_threads, SimdPath path);

// Decodes columns [0, n) of every row into out ([rows, out_stride] of `type`): code * scale in
// fp32, then rounded to the output type. With sum_rows, out is one row: the rows' decoded
// values added in row order in fp32 (the first row is the starting value), then rounded.
const char* dequantize_blocks(const void* codes, const float* scales, const QuantLayout& layout,
                              void* out, FloatType type, int64_t out_stride, bool sum_rows,
                              int num_threads, SimdPath path);

}  // namespace zengine
