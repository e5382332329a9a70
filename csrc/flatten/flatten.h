// Threaded copies between a list of buffers and one flat buffer (byte-wise, any dtype).
#pragma once

#include <cstdint>

namespace zengine {

enum class CopyDirection : int { kIntoFlat = 0, kOutOfFlat = 1 };

// parts[i] holds nbytes[i] bytes at byte offset sum(nbytes[:i]) of `flat`. kIntoFlat copies
// every part into flat (flatten); kOutOfFlat copies flat back into the parts (unflatten).
// The total is split into equal byte ranges across threads, so a few large parts and many
// small ones balance alike. Returns nullptr, or a static error message.
const char* copy_flat(char* flat, char* const* parts, const int64_t* nbytes, int64_t count,
                      CopyDirection direction, int num_threads);

}  // namespace zengine
