// See async_io.h. Each worker takes the next block (see the order there), runs it to
// completion (short transfers and EINTR are retried), and counts it off its request; `wait`
// sleeps until the request's count reaches zero.
#include "async_io.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace zengine {

AioPool::AioPool(int threads, int64_t block_bytes, bool priority)
    : block_bytes_(block_bytes > 0 ? block_bytes : (int64_t{1} << 20)), priority_(priority) {
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
  Request r;
  r.write = write;
  r.fd = fd;
  r.buf = buf;
  r.nbytes = nbytes > 0 ? nbytes : 0;
  r.offset = offset;
  r.blocks_left = (r.nbytes + block_bytes_ - 1) / block_bytes_;
  const bool queued = r.blocks_left > 0;
  requests_.emplace(id, r);
  if (queued) {
    (priority_ && write ? writes_ : reads_).push_back(id);
    have_work_.notify_all();
  }
  return id;
}

bool AioPool::next_block(Block* out) {
  std::deque<int64_t>* queue = !urgent_.empty() ? &urgent_ : !reads_.empty() ? &reads_ : &writes_;
  if (queue->empty()) return false;
  const int64_t id = queue->front();
  Request& r = requests_.find(id)->second;
  const int64_t n = std::min(block_bytes_, r.nbytes - r.issued);
  *out = Block{id, r.write, r.fd, r.buf + r.issued, n, r.offset + r.issued};
  r.issued += n;
  if (r.issued == r.nbytes) queue->pop_front();
  return true;
}

int AioPool::wait(int64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return EINVAL;
  Request& r = it->second;
  if (priority_ && !r.urgent && r.issued < r.nbytes) {  // the caller is blocked on it: serve it next
    auto& from = r.write ? writes_ : reads_;
    auto pos = std::find(from.begin(), from.end(), id);
    if (pos != from.end()) {
      from.erase(pos);
      urgent_.push_back(id);
      r.urgent = true;
    }
  }
  // Look the request up afresh each time: submits made while this waits may rehash the map.
  done_.wait(lock, [&] { return requests_.find(id)->second.blocks_left == 0; });
  it = requests_.find(id);
  const int error = it->second.error;
  requests_.erase(it);
  return error;
}

int AioPool::done(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return -1;
  return it->second.blocks_left == 0 ? 1 : 0;
}

AioStats AioPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  AioStats s = stats_;
  s.read_ns = busy_read_.total(now);
  s.write_ns = busy_write_.total(now);
  s.busy_ns = busy_any_.total(now);
  return s;
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
      have_work_.wait(lock, [&] { return stopping_ || !urgent_.empty() || !reads_.empty() || !writes_.empty(); });
      if (!next_block(&block)) return;  // stopping, and nothing left to do
      const auto now = Clock::now();
      (block.write ? busy_write_ : busy_read_).start(now);
      busy_any_.start(now);
    }
    const int error = run(block);
    bool finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto now = Clock::now();
      (block.write ? busy_write_ : busy_read_).stop(now);
      busy_any_.stop(now);
      Request& r = requests_.find(block.request)->second;
      if (error != 0 && r.error == 0) r.error = error;
      if (error == 0) (block.write ? stats_.bytes_written : stats_.bytes_read) += block.nbytes;
      finished = --r.blocks_left == 0;
      if (finished) ++(r.write ? stats_.writes : stats_.reads);
    }
    if (finished) done_.notify_all();
  }
}

}  // namespace zengine
