// io_uring through its raw system calls (no liburing, no libaio): io_uring_setup, the mmapped
// submission and completion rings, io_uring_enter. Only what the aio engine needs: reads and
// writes at file offsets, completions matched by user_data. Torch-free.
//
// Kernels: io_uring_setup exists since Linux 5.1; IORING_OP_READ/WRITE since 5.6 (found with
// IORING_REGISTER_PROBE; older kernels get READV/WRITEV with one iovec). Building needs the
// <linux/io_uring.h> of a >= 5.6 kernel; a build without it never offers a ring.
//
// Not thread-safe: one thread owns a Uring and makes every call on it (the engine's ring
// thread); nothing else touches the rings, so no SQPOLL and no locks.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ds {
namespace aio {

class Uring {
 public:
  // A ring for at least `entries` transfers queued or in flight, checked with a NOP round
  // trip (a seccomp filter may block io_uring_enter but not io_uring_setup), or nullptr with
  // `why` set ("io_uring_setup: Operation not permitted (errno 1) (...)").
  // vectored: READV/WRITEV even where READ/WRITE exist (tests the pre-5.6 path).
  static std::unique_ptr<Uring> create(unsigned entries, bool vectored, std::string& why);
  ~Uring();
  Uring(const Uring&) = delete;
  Uring& operator=(const Uring&) = delete;

  unsigned capacity() const;  // transfers that may be queued or in flight at once
  bool vectored() const;      // READV/WRITEV instead of READ/WRITE

  // Queues a transfer of `len` bytes between `buf` and `fd` at `offset`, whose completion
  // carries `user_data`. `iov` (used when vectored()) must live until that completion. The
  // caller keeps at most capacity() transfers queued or in flight, so neither ring overflows.
  void queue(bool read, int fd, char* buf, uint32_t len, int64_t offset, uint64_t user_data,
             iovec* iov);
  // Hands the queued transfers to the kernel and, when wait_for > 0, waits until that many
  // completions are ready. 0, or -errno: -EINTR, -EAGAIN and -EBUSY are worth another call
  // (what the kernel did not take stays queued); others mean the ring is unusable.
  int enter(unsigned wait_for);
  unsigned queued() const;  // queued transfers the kernel has not taken yet
  // Takes back the queued transfers the kernel has not taken; returns their user_data.
  std::vector<uint64_t> unqueue();
  // The next completion (res: bytes moved, or -errno); false when none is ready.
  bool next(uint64_t& user_data, int32_t& res);

  struct Rings;  // the mapped rings (aio_uring.cpp)

 private:
  explicit Uring(std::unique_ptr<Rings> r);
  std::unique_ptr<Rings> r_;
};

}  // namespace aio
}  // namespace ds
