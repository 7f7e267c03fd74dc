#include "aio/aio_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <system_error>

namespace ds {
namespace aio {

AlignedBuffer::~AlignedBuffer() { std::free(ptr_); }

char* AlignedBuffer::get(int64_t bytes) {
  if (bytes > size_) {
    std::free(ptr_);
    // A bounce buffer of a block or so gets a whole huge page (see aligned_alloc_bytes).
    const int64_t n = bytes >= kHugePage / 2 ? std::max(bytes, kHugePage) : bytes;
    ptr_ = static_cast<char*>(aligned_alloc_bytes(n));
    size_ = ptr_ ? round_up(n) : 0;
  }
  return ptr_;
}

void* aligned_alloc_bytes(int64_t bytes) {
  void* p = nullptr;
  const int64_t n = round_up(bytes > 0 ? bytes : 1);
  const bool huge = n >= kHugePage;
  if (posix_memalign(&p, size_t(huge ? kHugePage : kAlign), size_t(n)) != 0) return nullptr;
  if (huge) ::madvise(p, size_t(n), MADV_HUGEPAGE);  // a hint: refused, 4 KiB pages remain
  return p;
}

int open_file(const std::string& path, bool read, bool direct) {
  int flags = O_CLOEXEC | (read ? O_RDONLY : (O_WRONLY | O_CREAT));
  if (direct) flags |= O_DIRECT;
  int fd;
  do {
    // 0600: swap files hold model state, private to the training job's user.
    fd = ::open(path.c_str(), flags, 0600);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

IoResult transfer(int fd, bool read, char* buf, int64_t len, int64_t offset) {
  int64_t done = 0;
  while (done < len) {
    const size_t want = size_t(len - done);
    const off_t at = off_t(offset + done);
    const ssize_t n = read ? ::pread(fd, buf + done, want, at) : ::pwrite(fd, buf + done, want, at);
    if (n < 0) {
      if (errno == EINTR) continue;
      return {done, errno};
    }
    if (n == 0) break;  // end of file (read) or no progress (write): the caller words it
    done += n;
  }
  return {done, 0};
}

std::string errno_text(int err) {
  return std::error_code(err, std::generic_category()).message() + " (errno " +
         std::to_string(err) + ")";
}

}  // namespace aio
}  // namespace ds
