// Asynchronous file I/O: a pool of threads that split each request into blocks and run
// them with pread/pwrite, so several blocks (of one request or of many) are in flight at
// once and the caller's thread is free until it waits.
//
// Which block a free worker takes next (with `priority`, the default):
//   1. blocks of a request someone is waiting on (oldest such request first),
//   2. blocks of reads (the compute waits on them),
//   3. blocks of writes;
// within each class requests are served in the order they were submitted. Without
// `priority` all blocks run in submission order (one FIFO). A request's blocks are issued in
// file order, so a request that is being served keeps the drive streaming.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace zengine {

// Totals since the pool started. `*_ns` count wall time during which at least one block of
// that kind was inside pread/pwrite; `busy_ns` counts time with any block inside one.
struct AioStats {
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t reads = 0;   // requests completed
  int64_t writes = 0;  // requests completed
  int64_t read_ns = 0;
  int64_t write_ns = 0;
  int64_t busy_ns = 0;
};

class AioPool {
 public:
  // `threads` workers; requests are cut into blocks of `block_bytes` (the last may be shorter).
  AioPool(int threads, int64_t block_bytes, bool priority);
  ~AioPool();
  AioPool(const AioPool&) = delete;
  AioPool& operator=(const AioPool&) = delete;

  // Queue a read (write=false) of `nbytes` at file offset `offset` of `fd` into `buf`, or a
  // write from it. Returns the request's id. `buf` must stay valid until `wait` returns.
  int64_t submit(bool write, int fd, char* buf, int64_t nbytes, int64_t offset);

  // Block until request `id` is done; returns 0, an errno, or -1 when a read hit end of file.
  // With `priority`, the request's blocks not yet started go before all others.
  int wait(int64_t id);

  // 1 when request `id` is done (a later `wait` returns at once), 0 when not, -1 when unknown.
  int done(int64_t id);

  AioStats stats();

 private:
  using Clock = std::chrono::steady_clock;
  struct Request {
    bool write;
    int fd;
    char* buf;
    int64_t nbytes;
    int64_t offset;
    int64_t issued = 0;       // bytes handed to workers so far
    int64_t blocks_left = 0;  // blocks not yet finished
    int error = 0;
    bool urgent = false;
  };
  struct Block {
    int64_t request;
    bool write;
    int fd;
    char* buf;
    int64_t nbytes;
    int64_t offset;
  };
  struct Busy {  // wall time with at least one block of a kind in flight
    int active = 0;
    Clock::time_point since;
    int64_t ns = 0;
    void start(Clock::time_point now) {
      if (active++ == 0) since = now;
    }
    void stop(Clock::time_point now) {
      if (--active == 0) ns += std::chrono::duration_cast<std::chrono::nanoseconds>(now - since).count();
    }
    int64_t total(Clock::time_point now) const {
      return ns + (active > 0 ? std::chrono::duration_cast<std::chrono::nanoseconds>(now - since).count() : 0);
    }
  };

  void work();
  bool next_block(Block* out);  // under mu_; false when nothing is queued
  static int run(const Block& b);

  const int64_t block_bytes_;
  const bool priority_;
  std::mutex mu_;
  std::condition_variable have_work_;
  std::condition_variable done_;
  // ids of requests with blocks not yet handed out: waited-on ones, reads, writes (without
  // `priority` everything goes to reads_, which is then the single FIFO)
  std::deque<int64_t> urgent_, reads_, writes_;
  std::unordered_map<int64_t, Request> requests_;
  int64_t next_id_ = 1;
  bool stopping_ = false;
  AioStats stats_;
  Busy busy_read_, busy_write_, busy_any_;
  std::vector<std::thread> workers_;
};

}  // namespace zengine
