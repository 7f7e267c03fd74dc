// The engine's insides, shared by its two backends (see [Note: aio backends] in
// aio_engine.h): requests cut into pieces, the queue of pieces, per-request file descriptors,
// and the bookkeeping wait() reads. Torch-free; not for the binding.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "aio/aio_engine.h"
#include "aio/aio_file.h"
#include "aio/aio_uring.h"

namespace ds {
namespace aio {

constexpr int64_t kMaxInflight = 64;              // pieces in flight: pool threads or SQEs
constexpr int64_t kBounceMax = int64_t(4) << 20;  // bytes a bounce copy moves at a time

// One request in flight; its pieces share it (see [Note: aio pieces]).
struct Op {
  Request req;
  int64_t id = 0;  // Engine::submit's return value
  std::atomic<int64_t> pieces_left{0};
  std::atomic<bool> failed{false};  // pieces not started yet skip their I/O
  std::mutex mu;                    // guards everything below
  int fd_direct = -1;
  int fd_buffered = -1;
  bool direct_tried = false;
  bool direct_refused = false;  // O_DIRECT refused (or turned off): body pieces go buffered
  std::string error;

  std::string what() const;
  void fail_locked(const std::string& why);
  void fail(const std::string& why);
};

struct Piece {
  std::shared_ptr<Op> op;
  int64_t begin = 0;  // bytes into the request
  int64_t len = 0;
  bool direct = false;
};

// Cuts a request at kAlign file offsets into pieces of <= piece_bytes (always >= 1 piece).
std::vector<Piece> split(const std::shared_ptr<Op>& op, int64_t piece_bytes);

struct Engine::State {
  Config cfg;
  int64_t piece_bytes = kAlign;
  int64_t inflight = 1;   // pieces in flight at most
  mutable std::mutex mu;  // guards everything below but `ring`
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  std::deque<Piece> queue;
  bool stop = false;
  int64_t pending = 0;                  // submitted requests not finished
  int64_t last_id = 0;                  // of the latest request submitted
  int64_t completed = 0;                // finished since the last wait()
  std::unordered_set<int64_t> running;  // ids of requests not finished
  // id -> error of each failed request not yet reported: by wait_for(id) (its own), or by
  // wait() (the lowest id's, and how many more)
  std::map<int64_t, std::string> failed_ops;
  std::string buffered_reason;
  std::string backend = "threads";
  std::string backend_reason;
  std::vector<std::thread> workers;  // the pool, or the one ring thread
  std::unique_ptr<Uring> ring;       // set before the ring thread starts; then only its

  // Both backends (aio_engine.cpp).
  int fd_for(Op& op, bool& direct);  // the piece's fd; clears `direct` to go buffered
  void piece_done(Op& op);           // the op's last piece finishes it
  void finish(Op& op);
  void validate(Op& op);
  void note_buffered(const std::string& why);
  void note_threads(const std::string& why);  // io_uring is not (or no longer) used
  // The thread pool (aio_pool.cpp). run() also serves the ring thread once the ring broke.
  void worker();
  void run(const Piece& p, AlignedBuffer& bounce);
  // The io_uring backend (aio_uring_engine.cpp): the ring thread's body.
  void ring_loop();
};

}  // namespace aio
}  // namespace ds
