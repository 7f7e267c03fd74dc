// Async file I/O for ZeRO-Infinity's NVMe offload: a thread pool that reads and writes
// whole buffers in block_size pieces with pread/pwrite on O_DIRECT file descriptors.
// Torch-free: plain pointers and a config struct; the binding owns every check.
//
// [Note: aio pieces]
// A request (one buffer <-> one file range) is cut into pieces at kAlign file offsets:
//   head  [offset, next kAlign boundary)          buffered fd (O_DIRECT cannot start there)
//   body  kAlign-aligned runs of <= block_size     O_DIRECT fd; through the worker's aligned
//                                                  bounce buffer when the memory is not aligned
//   tail  the last < kAlign bytes                  buffered fd (O_DIRECT cannot end there)
// Head and tail never share a page with the body, so page-cache and direct writes never
// touch the same page; a later direct read of a page written through the cache is
// coherent (the kernel writes dirty pages back before direct reads of their range).
// A file system that refuses O_DIRECT (EINVAL at open or on the first transfer) gets
// buffered I/O for everything, with the reason printed once per process.
//
// Workers take pieces in submission order, so at most `threads` pieces (queue_depth *
// intra_op_parallelism, capped) are in flight. single_submit and overlap_events tune
// upstream's libaio submission; they have no counterpart in a thread pool and are kept
// only to be reported back.
//
// TODO(io_uring): an io_uring engine (raw io_uring_setup/io_uring_enter syscalls, no
// liburing) could keep queue_depth requests in flight from one thread; it needs runtime
// detection (ENOSYS, EPERM under seccomp, kernel.io_uring_disabled) and this pool as the
// fallback. Not done: the pool already keeps the device queue full.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace ds {
namespace aio {

struct Config {
  int64_t block_size = 1 << 20;  // bytes per piece (body pieces: rounded down to kAlign)
  int64_t queue_depth = 8;
  int64_t intra_op_parallelism = 1;
  bool single_submit = false;
  bool overlap_events = false;
  bool direct_io = true;  // false: never ask for O_DIRECT (DS_AIO_DIRECT=0)
};

struct Request {
  bool read;
  std::string path;
  char* buf;  // caller keeps it alive until wait() returns
  int64_t nbytes;
  int64_t offset;  // in the file
  bool validate;   // compare buffer and file through the page cache after the transfer
};

struct WaitResult {
  int64_t completed = 0;  // requests finished since the previous wait(), failed ones included
  std::string error;      // the first failure (names the file and the errno), "" if none
};

class Engine {
 public:
  explicit Engine(const Config& cfg);
  ~Engine();  // finishes every submitted request before the threads stop
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request and returns at once; errors are reported by wait().
  void submit(Request req);
  // Blocks until every submitted request has finished.
  WaitResult wait();

  int64_t pending() const;
  int64_t threads() const;
  const Config& config() const;
  // Why buffered I/O was used instead of O_DIRECT, "" while it never was.
  std::string buffered_reason() const;

  struct State;  // defined in aio_engine.cpp

 private:
  std::unique_ptr<State> s_;
};

}  // namespace aio
}  // namespace ds
