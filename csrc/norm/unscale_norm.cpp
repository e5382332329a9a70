// Unscale + sum of squares in one read (and, when unscaling, one write) of the gradient.
#include "unscale_norm.h"

#include <vector>

#include "simd.h"

namespace zengine {
namespace {

constexpr int kLineElems = 16;           // floats per 64-byte cache line
constexpr int64_t kPrefetchElems = 256;  // past the hardware prefetcher's 4 KiB page limit

template <class V>
inline double block_sum_squares(float* grad, int64_t begin, int64_t end, float scale) {
  const bool rescale = scale != 1.0f;
  const auto vscale = V::set1(scale);
  auto acc = V::acc_zero();
  int64_t i = begin;
  for (; i + V::kWidth <= end; i += V::kWidth) {
    if (i % kLineElems == 0) simd::prefetch_write(grad + i + kPrefetchElems);
    auto x = V::load(grad + i);
    if (rescale) {
      x = V::mul(x, vscale);
      V::store(grad + i, x);
    }
    acc = V::acc_squares(acc, x);
  }
  double tail = 0.0;
  for (; i < end; ++i) {
    float x = grad[i];
    if (rescale) grad[i] = x = x * scale;
    tail = simd::Scalar::acc_squares(tail, x);
  }
  return V::acc_sum(acc) + tail;
}

using BlockFn = double (*)(float*, int64_t, int64_t, float);

double block_scalar(float* g, int64_t b, int64_t e, float s) {
  return block_sum_squares<simd::Scalar>(g, b, e, s);
}
#if ZE_X86
ZE_TARGET_AVX2 __attribute__((flatten)) double block_avx2(float* g, int64_t b, int64_t e,
                                                          float s) {
  return block_sum_squares<simd::Avx2>(g, b, e, s);
}
ZE_TARGET_AVX512 __attribute__((flatten)) double block_avx512(float* g, int64_t b, int64_t e,
                                                              float s) {
  return block_sum_squares<simd::Avx512>(g, b, e, s);
}
#endif

BlockFn block_fn(SimdPath path) {
#if ZE_X86
  if (path == SimdPath::kAvx512) return block_avx512;
  if (path == SimdPath::kAvx2) return block_avx2;
#endif
  return block_scalar;
}

}  // namespace

const char* unscale_sum_squares(float* grad, int64_t n, float scale, double* sum_sq,
                                int num_threads, SimdPath path) {
  SimdPath resolved;
  if (const char* err = resolve_simd_path(path, &resolved)) return err;
  const BlockFn block = block_fn(resolved);
  std::vector<double> partial(static_cast<size_t>((n + kBlockElems - 1) / kBlockElems), 0.0);
  parallel_blocks(n, kBlockElems, num_threads, [&](int64_t b, int64_t begin, int64_t end) {
    partial[static_cast<size_t>(b)] = block(grad, begin, end, scale);
  });
  double total = 0.0;
  for (double part : partial) total += part;
  *sum_sq = total;
  return nullptr;
}

}  // namespace zengine
