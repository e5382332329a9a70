// Flatten / unflatten: each thread copies one contiguous byte range of the flat buffer,
// piece by piece across the parts it overlaps.
#include "flatten.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "dispatch.h"

namespace zengine {
namespace {

// 1 MiB per block: memcpy runs at full speed, and a 16 MiB copy still splits across threads.
constexpr int64_t kBlockBytes = int64_t{1} << 20;

}  // namespace

const char* copy_flat(char* flat, char* const* parts, const int64_t* nbytes, int64_t count,
                      CopyDirection direction, int num_threads) {
  std::vector<int64_t> offsets(static_cast<size_t>(count) + 1, 0);  // offsets[i]: start of part i
  for (int64_t i = 0; i < count; ++i) {
    if (nbytes[i] < 0) return "copy_flat: negative size";
    offsets[i + 1] = offsets[i] + nbytes[i];
  }
  const int64_t total = offsets.back();
  const bool into_flat = direction == CopyDirection::kIntoFlat;
  parallel_blocks(total, kBlockBytes, num_threads, [&](int64_t, int64_t begin, int64_t end) {
    // First part that ends after `begin`.
    int64_t i = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    for (int64_t pos = begin; pos < end; ++i) {
      const int64_t stop = std::min(end, offsets[i + 1]);
      if (stop <= pos) continue;  // empty part
      char* part = parts[i] + (pos - offsets[i]);
      if (into_flat) {
        std::memcpy(flat + pos, part, static_cast<size_t>(stop - pos));
      } else {
        std::memcpy(part, flat + pos, static_cast<size_t>(stop - pos));
      }
      pos = stop;
    }
  });
  return nullptr;
}

}  // namespace zengine
