#include "aio/aio_uring.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

#include "aio/aio_file.h"

#if defined(__NR_io_uring_setup) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define DS_AIO_HAVE_IO_URING 1
#else
#define DS_AIO_HAVE_IO_URING 0
#endif

namespace ds {
namespace aio {

#if DS_AIO_HAVE_IO_URING

namespace {

// The kernel reads the SQ tail and writes the CQ tail (and the SQ head) from other contexts:
// publish with release stores, read theirs with acquire loads.
unsigned load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

std::string setup_hint(int err) {
  if (err == ENOSYS) return " (kernel before 5.1, io_uring compiled out, or a seccomp filter)";
  if (err != EPERM) return "";
  std::ifstream f("/proc/sys/kernel/io_uring_disabled");
  int v = 0;
  if (f >> v && v != 0) return " (sysctl kernel.io_uring_disabled=" + std::to_string(v) + ")";
  return " (a seccomp filter, e.g. a container's default profile)";
}

// IORING_OP_READ/WRITE are offered (Linux >= 5.6). The probe itself is 5.6+: EINVAL before.
bool offers_read_write(int fd) {
  constexpr unsigned kOps = 256;
  std::vector<uint64_t> mem((sizeof(io_uring_probe) + kOps * sizeof(io_uring_probe_op)) / 8 + 1);
  auto* probe = reinterpret_cast<io_uring_probe*>(mem.data());
  if (syscall(__NR_io_uring_register, fd, IORING_REGISTER_PROBE, probe, kOps) < 0) return false;
  auto ok = [&](unsigned op) {
    return op < probe->ops_len && (probe->ops[op].flags & IO_URING_OP_SUPPORTED) != 0;
  };
  return ok(IORING_OP_READ) && ok(IORING_OP_WRITE);
}

void* map(int fd, size_t len, uint64_t what) {
  return ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, off_t(what));
}

}  // namespace

struct Uring::Rings {
  int fd = -1;
  void* sq_map = MAP_FAILED;
  size_t sq_len = 0;
  void* cq_map = MAP_FAILED;  // == sq_map with IORING_FEAT_SINGLE_MMAP
  size_t cq_len = 0;
  void* sqe_map = MAP_FAILED;
  size_t sqe_len = 0;
  io_uring_sqe* sqes = nullptr;
  unsigned* sq_head = nullptr;  // the kernel's: how far it has taken SQEs
  unsigned* sq_tail = nullptr;  // ours
  unsigned sq_mask = 0;
  unsigned sq_entries = 0;
  unsigned tail = 0;            // our copy of *sq_tail
  unsigned* cq_head = nullptr;  // ours
  unsigned* cq_tail = nullptr;  // the kernel's
  unsigned cq_mask = 0;
  io_uring_cqe* cqes = nullptr;
  bool vectored = false;

  ~Rings() {
    if (sqe_map != MAP_FAILED) ::munmap(sqe_map, sqe_len);
    if (cq_map != MAP_FAILED && cq_map != sq_map) ::munmap(cq_map, cq_len);
    if (sq_map != MAP_FAILED) ::munmap(sq_map, sq_len);
    if (fd >= 0) ::close(fd);
  }

  // The SQE at our tail, zeroed; push() hands it over.
  io_uring_sqe* next_sqe() {
    io_uring_sqe* sqe = &sqes[tail & sq_mask];
    std::memset(sqe, 0, sizeof *sqe);
    return sqe;
  }
  void push() { store_release(sq_tail, ++tail); }
};

Uring::Uring(std::unique_ptr<Rings> r) : r_(std::move(r)) {}
Uring::~Uring() = default;

std::unique_ptr<Uring> Uring::create(unsigned entries, bool vectored, std::string& why) {
  auto r = std::make_unique<Rings>();
  io_uring_params p{};
  const long fd = syscall(__NR_io_uring_setup, entries, &p);
  if (fd < 0) {
    const int err = errno;
    why = "io_uring_setup: " + errno_text(err) + setup_hint(err);
    return nullptr;
  }
  r->fd = int(fd);
  r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;  // Linux >= 5.4
  if (single) r->sq_len = r->cq_len = std::max(r->sq_len, r->cq_len);
  r->sq_map = map(r->fd, r->sq_len, IORING_OFF_SQ_RING);
  r->cq_map = single ? r->sq_map : map(r->fd, r->cq_len, IORING_OFF_CQ_RING);
  r->sqe_len = p.sq_entries * sizeof(io_uring_sqe);
  r->sqe_map = map(r->fd, r->sqe_len, IORING_OFF_SQES);
  if (r->sq_map == MAP_FAILED || r->cq_map == MAP_FAILED || r->sqe_map == MAP_FAILED) {
    why = "mmap of the io_uring rings: " + errno_text(errno);
    return nullptr;
  }
  char* sq = static_cast<char*>(r->sq_map);
  char* cq = static_cast<char*>(r->cq_map);
  r->sq_head = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
  r->sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
  r->sq_mask = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
  r->sq_entries = p.sq_entries;
  r->tail = *r->sq_tail;
  // SQE i always sits in array slot i: queue() fills the SQE at tail & mask.
  unsigned* array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
  for (unsigned i = 0; i < p.sq_entries; ++i) array[i] = i;
  r->sqes = static_cast<io_uring_sqe*>(r->sqe_map);
  r->cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
  r->cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
  r->cq_mask = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
  r->cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
  r->vectored = vectored || !offers_read_write(r->fd);

  std::unique_ptr<Uring> u(new Uring(std::move(r)));
  u->r_->next_sqe()->opcode = IORING_OP_NOP;
  u->r_->push();
  int err = -EINTR;
  for (int i = 0; i < 100 && (err == -EINTR || err == -EAGAIN); ++i) err = u->enter(1);
  uint64_t ud = 0;
  int32_t res = 0;
  if (err == 0 && !u->next(ud, res)) err = -EIO;  // cannot happen: enter waited for it
  if (err == 0 && res < 0) err = res;
  if (err != 0) {
    why = "io_uring_enter: " + errno_text(-err) + setup_hint(-err);
    return nullptr;
  }
  return u;
}

unsigned Uring::capacity() const { return r_->sq_entries; }

bool Uring::vectored() const { return r_->vectored; }

void Uring::queue(bool read, int fd, char* buf, uint32_t len, int64_t offset, uint64_t user_data,
                  iovec* iov) {
  io_uring_sqe* sqe = r_->next_sqe();
  sqe->fd = fd;
  sqe->off = uint64_t(offset);
  sqe->user_data = user_data;
  if (r_->vectored) {
    iov->iov_base = buf;
    iov->iov_len = len;
    sqe->opcode = read ? IORING_OP_READV : IORING_OP_WRITEV;
    sqe->addr = reinterpret_cast<uintptr_t>(iov);
    sqe->len = 1;
  } else {
    sqe->opcode = read ? IORING_OP_READ : IORING_OP_WRITE;
    sqe->addr = reinterpret_cast<uintptr_t>(buf);
    sqe->len = len;
  }
  r_->push();
}

int Uring::enter(unsigned wait_for) {
  const unsigned n = queued();
  if (n == 0 && wait_for == 0) return 0;
  const unsigned flags = wait_for > 0 ? IORING_ENTER_GETEVENTS : 0u;
  const long rc = syscall(__NR_io_uring_enter, r_->fd, n, wait_for, flags,
                          static_cast<void*>(nullptr), size_t(0));
  return rc < 0 ? -errno : 0;
}

unsigned Uring::queued() const { return r_->tail - load_acquire(r_->sq_head); }

std::vector<uint64_t> Uring::unqueue() {
  const unsigned head = load_acquire(r_->sq_head);
  std::vector<uint64_t> out;
  for (unsigned i = head; i != r_->tail; ++i) out.push_back(r_->sqes[i & r_->sq_mask].user_data);
  r_->tail = head;  // safe: without SQPOLL the kernel reads the SQ only inside io_uring_enter
  store_release(r_->sq_tail, head);
  return out;
}

bool Uring::next(uint64_t& user_data, int32_t& res) {
  const unsigned head = *r_->cq_head;  // only we write it
  if (head == load_acquire(r_->cq_tail)) return false;
  const io_uring_cqe& cqe = r_->cqes[head & r_->cq_mask];
  user_data = cqe.user_data;
  res = cqe.res;
  store_release(r_->cq_head, head + 1);  // the kernel may reuse the entry from here on
  return true;
}

#else  // no io_uring in this build: the engine always uses its thread pool

struct Uring::Rings {};
Uring::Uring(std::unique_ptr<Rings> r) : r_(std::move(r)) {}
Uring::~Uring() = default;
std::unique_ptr<Uring> Uring::create(unsigned, bool, std::string& why) {
  why = "built without <linux/io_uring.h> or __NR_io_uring_setup";
  return nullptr;
}
unsigned Uring::capacity() const { return 0; }
bool Uring::vectored() const { return false; }
void Uring::queue(bool, int, char*, uint32_t, int64_t, uint64_t, iovec*) {}
int Uring::enter(unsigned) { return -ENOSYS; }
unsigned Uring::queued() const { return 0; }
std::vector<uint64_t> Uring::unqueue() { return {}; }
bool Uring::next(uint64_t&, int32_t&) { return false; }

#endif

}  // namespace aio
}  // namespace ds
