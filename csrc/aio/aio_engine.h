// Async file I/O for ZeRO-Infinity's NVMe offload: reads and writes whole buffers in
// block_size pieces on O_DIRECT file descriptors, through io_uring where the kernel offers it
// and a pread/pwrite thread pool where it does not (see [Note: aio backends]).
// Torch-free: plain pointers and a config struct; the binding owns every check.
//
// [Note: aio pieces]
// A request (one buffer <-> one file range) is cut into pieces at kAlign file offsets:
//   head  [offset, next kAlign boundary)          buffered fd (O_DIRECT cannot start there)
//   body  kAlign-aligned runs of <= block_size     O_DIRECT fd; through an aligned bounce
//                                                  buffer when the memory is not aligned
//   tail  the last < kAlign bytes                  buffered fd (O_DIRECT cannot end there)
// Head and tail never share a page with the body, so page-cache and direct writes never
// touch the same page; a later direct read of a page written through the cache is
// coherent (the kernel writes dirty pages back before direct reads of their range).
// A file system that refuses O_DIRECT (EINVAL at open or on the first transfer) gets
// buffered I/O for everything, with the reason printed once per process.
//
// [Note: aio backends]
// Both take pieces in submission order from one queue and keep at most
// min(queue_depth * intra_op_parallelism, 64) pieces in flight; wait() and the error
// reporting are the same for both.
//   io_uring  one ring thread (aio_uring_engine.cpp) owns a ring (aio_uring.h: raw syscalls,
//             no liburing) and keeps one SQE in flight per piece, IORING_OP_READ/WRITE
//             (READV/WRITEV before Linux 5.6). Short transfers are resubmitted for the rest;
//             a short O_DIRECT transfer that ends off the alignment finishes buffered.
//   threads   a pool of that many threads (aio_pool.cpp), each piece a pread/pwrite loop.
// Each Engine tries io_uring_setup plus a NOP round trip once; any failure there (ENOSYS:
// kernel before 5.1; EPERM: seccomp or kernel.io_uring_disabled; EINVAL; ENOMEM) means the
// thread pool, with the reason printed once per process and kept in backend_reason().
// Config::io_uring = kOff (DS_AIO_IO_URING=0) asks for the pool outright. Should
// io_uring_enter fail for good later, the ring thread moves every piece left itself with
// pread/pwrite (no waiter is left behind).
// single_submit and overlap_events tune upstream's libaio submission; they have no
// counterpart here and are kept only to be reported back.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace ds {
namespace aio {

enum class IoUring {
  kOff,       // the thread pool (DS_AIO_IO_URING=0)
  kAuto,      // io_uring where the kernel offers it, else the thread pool
  kVectored,  // as kAuto, with READV/WRITEV even where READ/WRITE exist (for tests)
};

struct Config {
  int64_t block_size = 1 << 20;  // bytes per piece (body pieces: rounded down to kAlign)
  int64_t queue_depth = 8;
  int64_t intra_op_parallelism = 1;
  bool single_submit = false;
  bool overlap_events = false;
  bool direct_io = true;  // false: never ask for O_DIRECT (DS_AIO_DIRECT=0)
  IoUring io_uring = IoUring::kAuto;
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
  std::string error;      // the earliest failure not yet reported (file and errno), or ""
};

class Engine {
 public:
  explicit Engine(const Config& cfg);
  ~Engine();  // finishes every submitted request before its threads stop
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request and returns its id (1, 2, ... in submission order) at once; errors
  // are reported by wait() and wait_for(). Any thread may call submit(), wait(), wait_for()
  // and the getters; the backend's threads do the I/O.
  int64_t submit(Request req);
  // Blocks until every submitted request has finished.
  WaitResult wait();
  // Blocks until request `id` has finished, not the ones submitted after it (a read-ahead
  // several requests deep hands out its first buffer as soon as that one is read). Returns
  // its error ("" if none or if wait() already reported it), which wait() then leaves out:
  // each failure is reported once, to whoever waits for it first.
  // An id never returned by submit() is an error of the caller's: the binding checks.
  std::string wait_for(int64_t id);
  int64_t last_id() const;  // the id the latest submit() returned, 0 before any

  int64_t pending() const;
  int64_t threads() const;  // the ring thread (1) or the pool's threads
  const Config& config() const;
  // Why buffered I/O was used instead of O_DIRECT, "" while it never was.
  std::string buffered_reason() const;
  // "io_uring" or "threads" (see [Note: aio backends]).
  std::string backend() const;
  // Why not io_uring with READ/WRITE, "" while that is what runs.
  std::string backend_reason() const;

  struct State;  // aio_state.h

 private:
  std::unique_ptr<State> s_;
};

}  // namespace aio
}  // namespace ds
