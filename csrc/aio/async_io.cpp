// See async_io.h. Each worker takes the oldest queued block, runs it to completion (short
// transfers and EINTR are retried), and counts it off its request; `wait` sleeps until
// the request's count reaches zero.
#include "async_io.h"

#include <unistd.h>

#include <cerrno>

namespace zengine {

AioPool::AioPool(int threads, int64_t block_bytes)
    : block_bytes_(block_bytes > 0 ? block_bytes : (int64_t{1} << 20)) {
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

AioPool::~AioPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  have_work_.notify_all();
  for (auto& t : workers_) t.join();
}

int64_t AioPool::submit(bool write, int fd, char* buf, int64_t nbytes, int64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = next_id_++;
  const int64_t blocks = nbytes > 0 ? (nbytes + block_bytes_ - 1) / block_bytes_ : 0;
  requests_[id] = Request{blocks, 0};
  for (int64_t done = 0; done < nbytes; done += block_bytes_) {
    const int64_t n = nbytes - done < block_bytes_ ? nbytes - done : block_bytes_;
    queue_.push_back(Block{id, write, fd, buf + done, n, offset + done});
  }
  have_work_.notify_all();
  return id;
}

int AioPool::wait(int64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  if (requests_.find(id) == requests_.end()) return EINVAL;
  // Look the request up afresh each time: submits made while this waits may rehash the map.
  done_.wait(lock, [&] { return requests_.find(id)->second.blocks_left == 0; });
  auto it = requests_.find(id);
  const int error = it->second.error;
  requests_.erase(it);
  return error;
}

int AioPool::run(const Block& b) {
  int64_t moved = 0;
  while (moved < b.nbytes) {
    const ssize_t n = b.write ? pwrite(b.fd, b.buf + moved, static_cast<size_t>(b.nbytes - moved),
                                       static_cast<off_t>(b.offset + moved))
                              : pread(b.fd, b.buf + moved, static_cast<size_t>(b.nbytes - moved),
                                      static_cast<off_t>(b.offset + moved));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return -1;  // end of file before the block was read (or a write that made no progress)
    moved += n;
  }
  return 0;
}

void AioPool::work() {
  for (;;) {
    Block block;
    {
      std::unique_lock<std::mutex> lock(mu_);
      have_work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to do
      block = queue_.front();
      queue_.pop_front();
    }
    const int error = run(block);
    {
      std::lock_guard<std::mutex> lock(mu_);
      Request& r = requests_[block.request];
      if (error != 0 && r.error == 0) r.error = error;
      --r.blocks_left;
    }
    done_.notify_all();
  }
}

}  // namespace zengine
