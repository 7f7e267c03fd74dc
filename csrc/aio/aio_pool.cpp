// The thread-pool backend (see [Note: aio backends] in aio_engine.h): each worker takes the
// next piece from the queue and moves it with a pread/pwrite loop.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <utility>

#include "aio/aio_state.h"

namespace ds {
namespace aio {
namespace {

// A direct transfer; unaligned memory goes through `bounce` (file side already aligned).
IoResult direct_transfer(int fd, bool read, char* mem, int64_t len, int64_t off,
                         AlignedBuffer& bounce) {
  if (is_aligned(mem)) return transfer(fd, read, mem, len, off);
  int64_t done = 0;
  while (done < len) {
    const int64_t n = std::min(len - done, kBounceMax);
    char* b = bounce.get(n);
    if (b == nullptr) return {done, ENOMEM};
    if (!read) std::memcpy(b, mem + done, size_t(n));
    const IoResult r = transfer(fd, read, b, n, off + done);
    if (read) std::memcpy(mem + done, b, size_t(r.done));
    done += r.done;
    if (r.err != 0 || r.done < n) return {done, r.err};
  }
  return {done, 0};
}

}  // namespace

void Engine::State::run(const Piece& p, AlignedBuffer& bounce) {
  Op& op = *p.op;
  if (op.failed) return;
  const bool rd = op.req.read;
  char* mem = op.req.buf + p.begin;
  const int64_t off = op.req.offset + p.begin;
  bool direct = p.direct;
  int fd = fd_for(op, direct);
  if (fd < 0) return;
  int64_t done = 0;
  if (direct) {
    const IoResult r = direct_transfer(fd, rd, mem, p.len, off, bounce);
    done = r.done;
    if (r.err == EINVAL) {  // took O_DIRECT at open, refuses it on transfer
      {
        std::lock_guard<std::mutex> lk(op.mu);
        op.direct_refused = true;
      }
      note_buffered("the file system of '" + op.req.path + "' refuses O_DIRECT transfers (" +
                    std::string(rd ? "pread" : "pwrite") + ": " + errno_text(r.err) + ")");
    } else if (r.err != 0) {
      op.fail(std::string(rd ? "pread" : "pwrite") + " at file offset " +
              std::to_string(off + done) + ": " + errno_text(r.err));
      return;
    }
    // A short direct transfer (end of file inside the piece) is finished below, buffered.
  }
  if (done < p.len) {
    bool buffered = false;
    fd = fd_for(op, buffered);
    if (fd < 0) return;
    const IoResult r = transfer(fd, rd, mem + done, p.len - done, off + done);
    done += r.done;
    const std::string at = " at file offset " + std::to_string(off + done);
    if (r.err != 0) {
      op.fail(std::string(rd ? "pread" : "pwrite") + at + ": " + errno_text(r.err));
    } else if (done < p.len) {
      op.fail(rd ? "unexpected end of file" + at + " (the file is shorter than offset + bytes)"
                 : "short write" + at + " (the file system accepted no more bytes)");
    }
  }
}

void Engine::State::worker() {
  AlignedBuffer bounce;  // this thread's, for unaligned memory on O_DIRECT pieces
  for (;;) {
    Piece p;
    {
      std::unique_lock<std::mutex> lk(mu);
      work_cv.wait(lk, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop, and nothing left
      p = std::move(queue.front());
      queue.pop_front();
    }
    try {
      run(p, bounce);
    } catch (const std::exception& e) {  // e.g. bad_alloc: fail the op, never the process
      p.op->fail(std::string("internal error: ") + e.what());
    }
    piece_done(*p.op);
  }
}

}  // namespace aio
}  // namespace ds
