// Asynchronous file I/O: a pool of threads that split each request into blocks and run
// them with pread/pwrite, so several blocks (of one request or of many) are in flight at
// once and the caller's thread is free until it waits.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace zengine {

class AioPool {
 public:
  // `threads` workers; requests are cut into blocks of `block_bytes` (the last may be shorter).
  AioPool(int threads, int64_t block_bytes);
  ~AioPool();
  AioPool(const AioPool&) = delete;
  AioPool& operator=(const AioPool&) = delete;

  // Queue a read (write=false) of `nbytes` at file offset `offset` of `fd` into `buf`, or a
  // write from it. Returns the request's id. `buf` must stay valid until `wait` returns.
  int64_t submit(bool write, int fd, char* buf, int64_t nbytes, int64_t offset);

  // Block until request `id` is done; returns 0, an errno, or -1 when a read hit end of file.
  int wait(int64_t id);

 private:
  struct Block {
    int64_t request;
    bool write;
    int fd;
    char* buf;
    int64_t nbytes;
    int64_t offset;
  };
  struct Request {
    int64_t blocks_left;
    int error;
  };

  void work();
  static int run(const Block& b);

  const int64_t block_bytes_;
  std::mutex mu_;
  std::condition_variable have_work_;
  std::condition_variable done_;
  std::deque<Block> queue_;
  std::unordered_map<int64_t, Request> requests_;
  int64_t next_id_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace zengine
