#include "aio/aio_engine.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "aio/aio_file.h"

namespace ds {
namespace aio {
namespace {

constexpr int64_t kMaxThreads = 64;
constexpr int64_t kBounceMax = int64_t(4) << 20;  // bytes a bounce copy moves at a time
constexpr int64_t kValidateChunk = int64_t(1) << 20;

// One request in flight; its pieces share it (see [Note: aio pieces]).
struct Op {
  Request req;
  std::atomic<int64_t> pieces_left{0};
  std::atomic<bool> failed{false};  // later pieces skip their I/O
  std::mutex mu;                    // guards everything below
  int fd_direct = -1;
  int fd_buffered = -1;
  bool direct_tried = false;
  bool direct_refused = false;  // O_DIRECT refused (or turned off): body pieces go buffered
  std::string error;

  std::string what() const {
    return std::string(req.read ? "read of '" : "write of '") + req.path + "' (" +
           std::to_string(req.nbytes) + " bytes at file offset " + std::to_string(req.offset) + ")";
  }
  void fail_locked(const std::string& why) {
    if (error.empty()) error = "async_io: " + what() + " failed: " + why;
    failed = true;
  }
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lk(mu);
    fail_locked(why);
  }
};

struct Piece {
  std::shared_ptr<Op> op;
  int64_t begin = 0;  // bytes into the request
  int64_t len = 0;
  bool direct = false;
};

// Splits a request at kAlign file offsets (see [Note: aio pieces]).
std::vector<Piece> split(const std::shared_ptr<Op>& op, int64_t piece_bytes) {
  const int64_t n = op->req.nbytes;
  const int64_t off = op->req.offset;
  std::vector<Piece> out;
  if (n == 0) {  // still opens the file: a write of nothing creates it
    out.push_back({op, 0, 0, false});
    return out;
  }
  const int64_t head = std::min(n, (kAlign - off % kAlign) % kAlign);
  if (head > 0) out.push_back({op, 0, head, false});
  int64_t pos = head;
  while (n - pos >= kAlign) {
    const int64_t len = std::min(piece_bytes, round_down(n - pos));
    out.push_back({op, pos, len, true});
    pos += len;
  }
  if (pos < n) out.push_back({op, pos, n - pos, false});
  return out;
}

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

struct Engine::State {
  Config cfg;
  int64_t piece_bytes = kAlign;
  mutable std::mutex mu;  // guards everything below
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  std::deque<Piece> queue;
  bool stop = false;
  int64_t pending = 0;    // submitted requests not finished
  int64_t completed = 0;  // finished since the last wait()
  int64_t failures = 0;
  std::string first_error;
  std::string buffered_reason;
  std::vector<std::thread> workers;

  void worker();
  void run(const Piece& p, AlignedBuffer& bounce);
  int fd_for(Op& op, bool& direct);
  void validate(Op& op);
  void finish(Op& op);
  void note_buffered(const std::string& why);
};

void Engine::State::note_buffered(const std::string& why) {
  static std::once_flag printed;  // one line per process, however many files
  std::call_once(printed, [&] {
    std::fprintf(stderr,
                 "[deepspeed_ext] async_io: %s; using buffered I/O through the page cache "
                 "instead of O_DIRECT\n",
                 why.c_str());
  });
  std::lock_guard<std::mutex> lk(mu);
  if (buffered_reason.empty()) buffered_reason = why;
}

// The fd for a piece, opened on first use so that thousands of queued requests do not hold
// thousands of fds. Clears `direct` when the piece must go buffered. -1: the op has failed.
int Engine::State::fd_for(Op& op, bool& direct) {
  std::lock_guard<std::mutex> lk(op.mu);
  if (direct && !op.direct_tried) {
    op.direct_tried = true;
    if (!cfg.direct_io) {
      op.direct_refused = true;
    } else {
      op.fd_direct = open_file(op.req.path, op.req.read, true);
      if (op.fd_direct < 0) {
        const int err = errno;
        if (err != EINVAL) {
          op.fail_locked("open: " + errno_text(err));
          return -1;
        }
        op.direct_refused = true;
        note_buffered("the file system of '" + op.req.path +
                      "' refuses O_DIRECT (open: " + errno_text(err) + ")");
      }
    }
  }
  if (direct && !op.direct_refused) return op.fd_direct;
  direct = false;
  if (op.fd_buffered < 0) {
    op.fd_buffered = open_file(op.req.path, op.req.read, false);
    if (op.fd_buffered < 0) {
      op.fail_locked("open: " + errno_text(errno));
      return -1;
    }
  }
  return op.fd_buffered;
}

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

// Re-reads the file range through the page cache and compares it with the buffer.
void Engine::State::validate(Op& op) {
  const int fd = open_file(op.req.path, true, false);
  if (fd < 0) {
    op.fail("validate: open: " + errno_text(errno));
    return;
  }
  std::vector<char> chunk(size_t(std::min(op.req.nbytes, kValidateChunk)));
  for (int64_t pos = 0; pos < op.req.nbytes; pos += kValidateChunk) {
    const int64_t n = std::min(kValidateChunk, op.req.nbytes - pos);
    const IoResult r = transfer(fd, true, chunk.data(), n, op.req.offset + pos);
    if (r.err != 0 || r.done < n) {
      op.fail("validate: re-read at file offset " + std::to_string(op.req.offset + pos) + ": " +
              (r.err ? errno_text(r.err) : std::string("unexpected end of file")));
      break;
    }
    if (std::memcmp(chunk.data(), op.req.buf + pos, size_t(n)) != 0) {
      op.fail("validate: buffer and file differ within bytes [" + std::to_string(pos) + ", " +
              std::to_string(pos + n) + ")");
      break;
    }
  }
  ::close(fd);
}

void Engine::State::finish(Op& op) {
  if (!op.failed && op.req.validate) validate(op);
  {
    std::lock_guard<std::mutex> lk(op.mu);
    if (op.fd_direct >= 0) ::close(op.fd_direct);
    if (op.fd_buffered >= 0) ::close(op.fd_buffered);
    op.fd_direct = op.fd_buffered = -1;
  }
  std::lock_guard<std::mutex> lk(mu);
  --pending;
  ++completed;
  if (op.failed) {
    ++failures;
    if (first_error.empty()) first_error = op.error;
  }
  done_cv.notify_all();
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
    if (p.op->pieces_left.fetch_sub(1) == 1) finish(*p.op);
  }
}

Engine::Engine(const Config& cfg) : s_(new State) {
  s_->cfg = cfg;
  s_->piece_bytes = std::max(kAlign, round_down(cfg.block_size));
  if (!cfg.direct_io) s_->buffered_reason = "O_DIRECT turned off (direct_io=false)";
  const int64_t depth = std::max<int64_t>(1, cfg.queue_depth);
  const int64_t par = std::max<int64_t>(1, cfg.intra_op_parallelism);
  const int64_t n = std::min(kMaxThreads, depth * par);
  for (int64_t i = 0; i < n; ++i) s_->workers.emplace_back([st = s_.get()] { st->worker(); });
}

Engine::~Engine() {
  {
    std::unique_lock<std::mutex> lk(s_->mu);
    // The buffers of in-flight requests may be freed right after we return.
    s_->done_cv.wait(lk, [&] { return s_->pending == 0; });
    s_->stop = true;
  }
  s_->work_cv.notify_all();
  for (auto& t : s_->workers) t.join();
}

void Engine::submit(Request req) {
  auto op = std::make_shared<Op>();
  op->req = std::move(req);
  std::vector<Piece> pieces = split(op, s_->piece_bytes);
  op->pieces_left = int64_t(pieces.size());
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    ++s_->pending;
    for (auto& p : pieces) s_->queue.push_back(std::move(p));
  }
  if (pieces.empty()) {  // cannot happen (split yields >= 1); an op with none would never finish
    op->fail("internal error: no I/O pieces");
    s_->finish(*op);
    return;
  }
  s_->work_cv.notify_all();
}

WaitResult Engine::wait() {
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->done_cv.wait(lk, [&] { return s_->pending == 0; });
  WaitResult r;
  r.completed = s_->completed;
  r.error = s_->first_error;
  if (s_->failures > 1) {
    r.error += " (and " + std::to_string(s_->failures - 1) + " more failed requests)";
  }
  s_->completed = 0;
  s_->failures = 0;
  s_->first_error.clear();
  return r;
}

int64_t Engine::pending() const {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->pending;
}

int64_t Engine::threads() const { return int64_t(s_->workers.size()); }

const Config& Engine::config() const { return s_->cfg; }

std::string Engine::buffered_reason() const {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->buffered_reason;
}

}  // namespace aio
}  // namespace ds
