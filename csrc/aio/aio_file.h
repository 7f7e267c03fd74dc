// File-level pieces of the async I/O core: opening with or without O_DIRECT, full-length
// pread/pwrite loops, aligned buffers, errno text. Torch-free.
#pragma once

#include <cstdint>
#include <string>

namespace ds {
namespace aio {

// O_DIRECT needs the file offset, the length and the memory address aligned to the device's
// logical block (512 or 4096 bytes) or its DMA alignment: 4096 satisfies all of them.
constexpr int64_t kAlign = 4096;

inline bool is_aligned(int64_t v) { return v % kAlign == 0; }
inline bool is_aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % kAlign == 0; }
inline int64_t round_down(int64_t v) { return v / kAlign * kAlign; }
inline int64_t round_up(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// A kAlign-aligned heap buffer (a worker's or a ring slot's bounce buffer), allocated on first
// use; from kHugePage / 2 bytes on, a whole huge page.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();
  // The buffer, grown to at least `bytes`; nullptr when the allocation fails.
  char* get(int64_t bytes);

 private:
  char* ptr_ = nullptr;
  int64_t size_ = 0;
};

// Allocations of >= kHugePage start on a kHugePage boundary and ask for transparent huge
// pages (MADV_HUGEPAGE; THP's "madvise" mode gives none without it). Measured on virtio-blk
// (io_uring, 1 GiB in 1 MiB blocks): reads 2.1 -> 2.9 GB/s, writes 2.5 -> 3.2 GB/s, reads
// through a bounce buffer 1.1 -> 3.3 GB/s. The likely reason: in 4 KiB pages a 1 MiB O_DIRECT
// request is up to 256 DMA segments, over the device's max_segments (254 there), so the
// block layer splits it; in a huge page it is one.
constexpr int64_t kHugePage = int64_t(2) << 20;

// Page-aligned allocation of at least `bytes` (rounded up to kAlign); release with free().
void* aligned_alloc_bytes(int64_t bytes);

// Opens `path` for reading, or for writing (created 0600 if missing, never truncated: a
// write at an offset must keep the rest of the file). With direct=true adds O_DIRECT.
// Returns the fd, or -1 with errno set.
int open_file(const std::string& path, bool read, bool direct);

struct IoResult {
  int64_t done;  // bytes transferred
  int err;       // errno of the failing call, 0 when none failed
};

// Moves `len` bytes between `buf` and the file at `offset`, resuming after short transfers
// and EINTR. Stops at the first error, at end of file (a read that returns 0), or at a
// write that makes no progress; `done` then tells how far it got.
IoResult transfer(int fd, bool read, char* buf, int64_t len, int64_t offset);

// "No space left on device (errno 28)": thread-safe, unlike strerror.
std::string errno_text(int err);

}  // namespace aio
}  // namespace ds
