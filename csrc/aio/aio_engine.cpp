// The Engine and what its two backends share (see [Note: aio backends] in aio_engine.h):
// splitting, file descriptors, validation, completion accounting, backend choice.
#include "aio/aio_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

#include "aio/aio_state.h"

namespace ds {
namespace aio {
namespace {

constexpr int64_t kValidateChunk = int64_t(1) << 20;

}  // namespace

std::string Op::what() const {
  return std::string(req.read ? "read of '" : "write of '") + req.path + "' (" +
         std::to_string(req.nbytes) + " bytes at file offset " + std::to_string(req.offset) + ")";
}

void Op::fail_locked(const std::string& why) {
  if (error.empty()) error = "async_io: " + what() + " failed: " + why;
  failed = true;
}

void Op::fail(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu);
  fail_locked(why);
}

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

void Engine::State::note_threads(const std::string& why) {
  static std::once_flag printed;  // one line per process, however many handles
  std::call_once(printed, [&] {
    std::fprintf(stderr, "[deepspeed_ext] async_io: %s; using pread/pwrite threads\n", why.c_str());
  });
  std::lock_guard<std::mutex> lk(mu);
  backend = "threads";
  backend_reason = why;
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

void Engine::State::piece_done(Op& op) {
  if (op.pieces_left.fetch_sub(1) == 1) finish(op);
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
  running.erase(op.id);
  if (op.failed) failed_ops[op.id] = op.error;
  done_cv.notify_all();
}

Engine::Engine(const Config& cfg) : s_(new State) {
  State& s = *s_;
  s.cfg = cfg;
  s.piece_bytes = std::max(kAlign, round_down(cfg.block_size));
  if (!cfg.direct_io) s.buffered_reason = "O_DIRECT turned off (direct_io=false)";
  const int64_t depth = std::max<int64_t>(1, cfg.queue_depth);
  const int64_t par = std::max<int64_t>(1, cfg.intra_op_parallelism);
  s.inflight = std::min(kMaxInflight, depth * par);
  if (cfg.io_uring == IoUring::kOff) {
    s.backend_reason = "io_uring turned off (DS_AIO_IO_URING=0)";
  } else {
    std::string why;
    s.ring = Uring::create(unsigned(s.inflight), cfg.io_uring == IoUring::kVectored, why);
    if (s.ring == nullptr) {
      s.note_threads("io_uring unavailable: " + why);
    } else {
      s.backend = "io_uring";
      if (s.ring->vectored()) {
        s.backend_reason = cfg.io_uring == IoUring::kVectored
                               ? "READV/WRITEV asked for (DS_AIO_IO_URING=vectored)"
                               : "READV/WRITEV: the kernel has no IORING_OP_READ (before 5.6)";
      }
      s.workers.emplace_back([st = &s] { st->ring_loop(); });
      return;
    }
  }
  for (int64_t i = 0; i < s.inflight; ++i) s.workers.emplace_back([st = &s] { st->worker(); });
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

int64_t Engine::submit(Request req) {
  auto op = std::make_shared<Op>();
  op->req = std::move(req);
  std::vector<Piece> pieces = split(op, s_->piece_bytes);
  op->pieces_left = int64_t(pieces.size());
  int64_t id = 0;
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->running.insert(s_->last_id + 1);  // first: should it throw, nothing has changed
    id = op->id = ++s_->last_id;
    ++s_->pending;
    for (auto& p : pieces) s_->queue.push_back(std::move(p));
  }
  if (pieces.empty()) {  // cannot happen (split yields >= 1); an op with none would never finish
    op->fail("internal error: no I/O pieces");
    s_->finish(*op);
    return id;
  }
  s_->work_cv.notify_all();
  return id;
}

std::string Engine::wait_for(int64_t id) {
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->done_cv.wait(lk, [&] { return s_->running.count(id) == 0; });
  const auto it = s_->failed_ops.find(id);
  if (it == s_->failed_ops.end()) return "";
  std::string error = std::move(it->second);
  s_->failed_ops.erase(it);
  return error;
}

int64_t Engine::last_id() const {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->last_id;
}

WaitResult Engine::wait() {
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->done_cv.wait(lk, [&] { return s_->pending == 0; });
  WaitResult r;
  r.completed = s_->completed;
  if (!s_->failed_ops.empty()) {
    r.error = s_->failed_ops.begin()->second;
    const size_t more = s_->failed_ops.size() - 1;
    if (more > 0) r.error += " (and " + std::to_string(more) + " more failed requests)";
  }
  s_->completed = 0;
  s_->failed_ops.clear();
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

std::string Engine::backend() const {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->backend;
}

std::string Engine::backend_reason() const {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->backend_reason;
}

}  // namespace aio
}  // namespace ds
