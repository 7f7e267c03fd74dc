// The io_uring backend (see [Note: aio backends] in aio_engine.h): one ring thread moves
// pieces from the queue into slots, keeps one SQE in flight per busy slot, and handles every
// completion: the rest of a short transfer goes in another SQE, an O_DIRECT refusal or a
// short direct transfer continues buffered, and a request's last piece finishes it.
//
// Threads: only the ring thread touches the ring and the slots; other threads only append to
// the queue (under State::mu), so the ring has exactly one submitter. While pieces are in
// flight the ring thread sleeps in io_uring_enter, not on work_cv: pieces queued meanwhile
// start at the next completion.
//
// Invariant (no waiter is ever left behind): once start() or complete() returns, its slot
// either has an SQE queued or in the kernel, or is free with its piece counted done.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

#include "aio/aio_state.h"

namespace ds {
namespace aio {
namespace {

// One SQE's len is 32 bits, and Linux moves at most ~2 GiB per read/write call.
constexpr int64_t kMaxSqeBytes = int64_t(1) << 30;

struct Slot {
  Piece piece;             // piece.op == nullptr: the slot is free
  int64_t done = 0;        // bytes of the piece moved so far
  int64_t moving = 0;      // bytes the SQE in flight moves
  char* io = nullptr;      // where they move: the caller's memory, or `bounce`
  int fd = -1;             // the op's direct or buffered fd
  bool direct = false;     // fd is the O_DIRECT one
  bool in_flight = false;  // an SQE for the slot is queued or in the kernel
  AlignedBuffer bounce;    // O_DIRECT with memory that does not start on a page
  iovec iov{};             // READV/WRITEV's, alive until the completion
};

std::string at(int64_t off) { return " at file offset " + std::to_string(off); }

class RingLoop {
 public:
  RingLoop(Engine::State& s, Uring& ring, int64_t slots)
      : s_(s), ring_(ring), slots_(size_t(std::max<int64_t>(1, slots))) {
    for (size_t i = slots_.size(); i-- > 0;) free_.push_back(i);
  }
  void run();

 private:
  size_t busy() const { return slots_.size() - free_.size(); }
  void start(Piece p);
  void issue(size_t i);
  void complete(size_t i, int32_t res);
  void go_buffered(size_t i);
  void release(size_t i);
  void recover(size_t i, const std::exception& e);
  void step();
  void broke(int err);

  Engine::State& s_;
  Uring& ring_;
  std::vector<Slot> slots_;  // never resized: SQEs point into them (iov)
  std::vector<size_t> free_;
  std::string broken_;  // why the ring is no longer used; "" while it is
};

void RingLoop::run() {
  std::vector<Piece> got;
  for (;;) {
    got.clear();
    {
      std::unique_lock<std::mutex> lk(s_.mu);
      if (busy() == 0) s_.work_cv.wait(lk, [&] { return s_.stop || !s_.queue.empty(); });
      if (busy() == 0 && s_.queue.empty()) return;  // stop, and nothing left
      while (got.size() < free_.size() && !s_.queue.empty()) {
        got.push_back(std::move(s_.queue.front()));
        s_.queue.pop_front();
      }
    }
    for (Piece& p : got) start(std::move(p));
    if (busy() > 0) step();
  }
}

void RingLoop::start(Piece p) {
  if (p.op->failed) {  // an earlier piece failed: skip the I/O
    s_.piece_done(*p.op);
    return;
  }
  const size_t i = free_.back();
  free_.pop_back();
  Slot& sl = slots_[i];
  sl.piece = std::move(p);
  sl.done = 0;
  sl.direct = sl.piece.direct;
  try {
    sl.fd = s_.fd_for(*sl.piece.op, sl.direct);
    if (sl.fd < 0 || sl.piece.len == 0) {  // open failed, or an empty request: opened is done
      release(i);
      return;
    }
    issue(i);
  } catch (const std::exception& e) {
    recover(i, e);
  }
}

// Queues an SQE for what the slot's piece has left (or, once the ring broke, moves it here).
void RingLoop::issue(size_t i) {
  Slot& sl = slots_[i];
  Op& op = *sl.piece.op;
  const int64_t left = sl.piece.len - sl.done;
  char* mem = op.req.buf + sl.piece.begin + sl.done;
  const int64_t off = op.req.offset + sl.piece.begin + sl.done;
  if (!broken_.empty()) {
    s_.run(Piece{sl.piece.op, sl.piece.begin + sl.done, left, sl.direct}, sl.bounce);
    release(i);
    return;
  }
  sl.moving = std::min(left, kMaxSqeBytes);
  sl.io = mem;
  if (sl.direct && !is_aligned(mem)) {
    sl.moving = std::min(sl.moving, kBounceMax);
    sl.io = sl.bounce.get(sl.moving);
    if (sl.io == nullptr) {
      op.fail(std::string("bounce buffer") + at(off) + ": " + errno_text(ENOMEM));
      release(i);
      return;
    }
    if (!op.req.read) std::memcpy(sl.io, mem, size_t(sl.moving));
  }
  ring_.queue(op.req.read, sl.fd, sl.io, uint32_t(sl.moving), off, uint64_t(i), &sl.iov);
  sl.in_flight = true;
}

void RingLoop::complete(size_t i, int32_t res) {
  Slot& sl = slots_[i];
  sl.in_flight = false;
  Op& op = *sl.piece.op;
  const bool rd = op.req.read;
  const std::string rw = rd ? "io_uring read" : "io_uring write";
  const int64_t off = op.req.offset + sl.piece.begin + sl.done;
  if (op.failed) {  // another piece failed: skip the rest of this one
    release(i);
    return;
  }
  if (res == -EINTR || res == -EAGAIN) {
    issue(i);
    return;
  }
  if (res == -EINVAL && sl.direct) {  // took O_DIRECT at open, refuses it on transfer
    {
      std::lock_guard<std::mutex> lk(op.mu);
      op.direct_refused = true;
    }
    s_.note_buffered("the file system of '" + op.req.path + "' refuses O_DIRECT transfers (" + rw +
                     ": " + errno_text(EINVAL) + ")");
    go_buffered(i);
    return;
  }
  if (res < 0) {
    op.fail(rw + at(off) + ": " + errno_text(-res));
    release(i);
    return;
  }
  char* mem = op.req.buf + sl.piece.begin + sl.done;
  if (rd && sl.io != mem) std::memcpy(mem, sl.io, size_t(res));
  sl.done += res;
  if (sl.done == sl.piece.len) {
    release(i);
    return;
  }
  if (res == 0 && !sl.direct) {  // end of file, or a write that made no progress
    op.fail(rd ? "unexpected end of file" + at(off) + " (the file is shorter than offset + bytes)"
               : "short write" + at(off) + " (the file system accepted no more bytes)");
    release(i);
    return;
  }
  // A short transfer: the rest goes in another SQE. O_DIRECT cannot go on after nothing moved
  // (end of file inside the piece) or from an offset off the alignment: buffered then.
  if (sl.direct && (res == 0 || !is_aligned(sl.done))) {
    go_buffered(i);
    return;
  }
  issue(i);
}

void RingLoop::go_buffered(size_t i) {
  Slot& sl = slots_[i];
  sl.direct = false;
  sl.fd = s_.fd_for(*sl.piece.op, sl.direct);
  if (sl.fd < 0) {
    release(i);
    return;
  }
  issue(i);
}

void RingLoop::release(size_t i) {
  Slot& sl = slots_[i];
  std::shared_ptr<Op> op = std::move(sl.piece.op);
  sl.piece = Piece{};
  sl.in_flight = false;
  free_.push_back(i);
  s_.piece_done(*op);
}

// An exception (e.g. bad_alloc) while handling slot i: fail its op, never the process.
void RingLoop::recover(size_t i, const std::exception& e) {
  Slot& sl = slots_[i];
  if (sl.piece.op == nullptr) throw;  // from finishing the op: nothing left to clean up
  sl.piece.op->fail(std::string("internal error: ") + e.what());
  if (!sl.in_flight) release(i);
}

// Handles one completion, waiting for it when none is ready. What is queued goes to the kernel
// first, so the device stays busy while this thread copies out of a bounce buffer or finishes
// an op; then run() refills the slot before the next completion.
void RingLoop::step() {
  uint64_t ud = 0;
  int32_t res = 0;
  int err = 0;
  const bool ready = ring_.next(ud, res);
  if (broken_.empty() && (!ready || ring_.queued() > 0)) {
    err = ring_.enter(ready ? 0 : 1);  // every busy slot has an SQE: a completion will come
    if (err != 0 && err != -EINTR && err != -EAGAIN && err != -EBUSY) broke(err);
  }
  // After broke() too: the kernel finishes what it took, into the CQ.
  if (!ready && !ring_.next(ud, res)) {
    // Nothing yet: the kernel took no SQE (EAGAIN, EBUSY) or the ring broke and we poll it.
    // The sleep is a system call, so it also runs the task work that posts completions.
    if (err != -EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return;
  }
  const size_t i = size_t(ud);
  try {
    complete(i, res);
  } catch (const std::exception& e) {
    recover(i, e);
  }
}

// io_uring_enter failed for good: what the kernel never took, and every piece from now on,
// moves here with pread/pwrite; what it took still completes into the CQ.
void RingLoop::broke(int err) {
  broken_ = "io_uring_enter failed: " + errno_text(-err);
  std::fprintf(stderr, "[deepspeed_ext] async_io: %s; using pread/pwrite on the ring thread\n",
               broken_.c_str());
  {
    std::lock_guard<std::mutex> lk(s_.mu);
    s_.backend = "threads";
    s_.backend_reason = broken_ + " (pread/pwrite on the ring thread since)";
  }
  for (uint64_t ud : ring_.unqueue()) {
    const size_t i = size_t(ud);
    slots_[i].in_flight = false;
    try {
      issue(i);
    } catch (const std::exception& e) {
      recover(i, e);
    }
  }
}

}  // namespace

void Engine::State::ring_loop() {
  RingLoop(*this, *ring, std::min<int64_t>(inflight, int64_t(ring->capacity()))).run();
}

}  // namespace aio
}  // namespace ds
