// Run-time choice of the SIMD path, and the block-parallel loop every kernel uses.
//
// The path is the widest one the CPU (and OS) supports, unless the caller names one or the
// environment variable ZENGINE_SIMD=avx512|avx2|scalar does (tests force each in turn). A
// named path the CPU lacks is an error, never a silent downgrade.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "simd.h"

namespace zengine {

enum class SimdPath : int { kAuto = -1, kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* simd_path_name(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar: return "scalar";
    case SimdPath::kAvx2: return "avx2";
    case SimdPath::kAvx512: return "avx512";
    default: return "auto";
  }
}

inline bool simd_path_supported(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar: return true;
#if ZE_X86
    // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
    case SimdPath::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case SimdPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && simd_path_supported(SimdPath::kAvx2);
#endif
    default: return false;
  }
}

inline SimdPath best_simd_path() {
  for (SimdPath path : {SimdPath::kAvx512, SimdPath::kAvx2}) {
    if (simd_path_supported(path)) return path;
  }
  return SimdPath::kScalar;
}

// Resolves `requested` (kAuto: ZENGINE_SIMD, else the best path) into `*out`.
// Returns nullptr, or a static error message.
inline const char* resolve_simd_path(SimdPath requested, SimdPath* out) {
  if (requested == SimdPath::kAuto) {
    const char* env = std::getenv("ZENGINE_SIMD");
    if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) {
      *out = best_simd_path();
      return nullptr;
    }
    if (std::strcmp(env, "scalar") == 0) {
      requested = SimdPath::kScalar;
    } else if (std::strcmp(env, "avx2") == 0) {
      requested = SimdPath::kAvx2;
    } else if (std::strcmp(env, "avx512") == 0) {
      requested = SimdPath::kAvx512;
    } else {
      return "ZENGINE_SIMD must be one of auto, avx512, avx2, scalar";
    }
  }
  if (!simd_path_supported(requested)) {
    return requested == SimdPath::kAvx512 ? "SIMD path avx512 requested, but this CPU has no AVX-512F"
         : requested == SimdPath::kAvx2   ? "SIMD path avx2 requested, but this CPU lacks AVX2/FMA/F16C"
                                          : "unknown SIMD path requested";
  }
  *out = requested;
  return nullptr;
}

// Elements per block: a multiple of every vector width (16 floats = one cache line), large
// enough that the per-block call is noise, small enough to balance two or more threads.
constexpr int64_t kBlockElems = int64_t{1} << 16;

// Calls fn(block_index, begin, end) over [0, n) in blocks of `block`, OpenMP static schedule
// (each thread gets one contiguous run of blocks). One block or one thread: no parallel region.
template <class Fn>
void parallel_blocks(int64_t n, int64_t block, int num_threads, const Fn& fn) {
  const int64_t blocks = (n + block - 1) / block;
  if (num_threads <= 1 || blocks <= 1) {
    for (int64_t b = 0; b < blocks; ++b) fn(b, b * block, std::min(n, (b + 1) * block));
    return;
  }
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, blocks));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) fn(b, b * block, std::min(n, (b + 1) * block));
}

}  // namespace zengine
