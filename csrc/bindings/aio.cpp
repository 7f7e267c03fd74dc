// torch binding of the async I/O op: the aio_handle class (upstream's method names), the
// checks of every input, and page-aligned CPU tensors. The core (csrc/aio/) sees no tensor.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "aio/aio_engine.h"
#include "aio/aio_file.h"

namespace {

using ds::aio::errno_text;

void check_buffer(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), op, ": buffer is undefined");
  TORCH_CHECK(t.device().is_cpu(), op, ": buffer is on ", t.device(),
              "; async_io moves CPU tensors only (stage device tensors through a CPU buffer)");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": buffer has layout ", t.layout(),
              "; dense tensors only");
  TORCH_CHECK(t.is_contiguous(), op, ": buffer is not contiguous; pass t.contiguous()");
}

void check_file_args(const std::string& f, int64_t offset, const char* op) {
  TORCH_CHECK(!f.empty(), op, ": filename is empty");
  TORCH_CHECK(offset >= 0, op, ": file_offset=", offset, " must be >= 0");
}

// Reads: the file exists and holds offset + nbytes bytes (a short file would otherwise
// surface later, from a worker, as an end-of-file error).
void check_readable(const std::string& f, int64_t offset, int64_t nbytes, const char* op) {
  struct stat st{};
  if (::stat(f.c_str(), &st) != 0) {
    const int err = errno;
    TORCH_CHECK(false, op, ": cannot read '", f, "': ", errno_text(err));
  }
  TORCH_CHECK(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode), op, ": '", f, "' is not a regular file");
  if (S_ISBLK(st.st_mode)) return;  // st_size is 0 for block devices
  TORCH_CHECK(offset + nbytes <= int64_t(st.st_size), op, ": '", f, "' has ", st.st_size,
              " bytes, but reading ", nbytes, " bytes at file offset ", offset, " needs ",
              offset + nbytes, " (was it written completely?)");
}

// Writes: the directory exists and the target is not a directory.
void check_writable(const std::string& f, const char* op) {
  const auto slash = f.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : f.substr(0, slash));
  struct stat st{};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    TORCH_CHECK(false, op, ": cannot write '", f, "': directory '", dir, "': ", errno_text(err));
  }
  TORCH_CHECK(S_ISDIR(st.st_mode), op, ": cannot write '", f, "': '", dir, "' is not a directory");
  TORCH_CHECK(::stat(f.c_str(), &st) != 0 || !S_ISDIR(st.st_mode), op, ": cannot write '", f,
              "': it is a directory");
}

// DS_AIO_IO_URING: unset, "1" or "auto": io_uring where the kernel offers it; "0": the
// thread pool; "vectored": io_uring with READV/WRITEV (the pre-5.6 path, for tests).
ds::aio::IoUring io_uring_from_env() {
  const char* env = std::getenv("DS_AIO_IO_URING");
  const std::string v = env ? env : "";
  if (v.empty() || v == "1" || v == "auto" || v == "true") return ds::aio::IoUring::kAuto;
  if (v == "0" || v == "false") return ds::aio::IoUring::kOff;
  TORCH_CHECK(v == "vectored", "aio_handle: DS_AIO_IO_URING=", v,
              " is not one of 1/auto (io_uring where offered), 0 (thread pool), vectored");
  return ds::aio::IoUring::kVectored;
}

ds::aio::Config make_config(int64_t block_size, int64_t queue_depth, bool single_submit,
                            bool overlap_events, int64_t intra_op_parallelism) {
  constexpr const char* op = "aio_handle";
  TORCH_CHECK(block_size >= 1 && block_size <= (int64_t(1) << 30), op, ": block_size=", block_size,
              " must be in [1, 2^30] bytes");
  TORCH_CHECK(queue_depth >= 1 && queue_depth <= 65536, op, ": queue_depth=", queue_depth,
              " must be in [1, 65536]");
  TORCH_CHECK(intra_op_parallelism >= 1 && intra_op_parallelism <= 1024, op,
              ": intra_op_parallelism=", intra_op_parallelism, " must be in [1, 1024]");
  ds::aio::Config c;
  c.block_size = block_size;
  c.queue_depth = queue_depth;
  c.single_submit = single_submit;
  c.overlap_events = overlap_events;
  c.intra_op_parallelism = intra_op_parallelism;
  // DS_AIO_DIRECT=0 turns O_DIRECT off (a file system that takes it but is slow with it).
  const char* env = std::getenv("DS_AIO_DIRECT");
  c.direct_io = !(env && (std::string(env) == "0" || std::string(env) == "false"));
  c.io_uring = io_uring_from_env();
  return c;
}

class AioHandle : public torch::CustomClassHolder {
 public:
  AioHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
            int64_t intra_op_parallelism)
      : engine_(make_config(block_size, queue_depth, single_submit, overlap_events,
                            intra_op_parallelism)) {}

  int64_t get_block_size() const { return engine_.config().block_size; }
  int64_t get_queue_depth() const { return engine_.config().queue_depth; }
  bool get_single_submit() const { return engine_.config().single_submit; }
  bool get_overlap_events() const { return engine_.config().overlap_events; }
  int64_t get_intra_op_parallelism() const { return engine_.config().intra_op_parallelism; }
  int64_t get_alignment() const { return ds::aio::kAlign; }
  int64_t get_thread_count() const { return engine_.threads(); }
  int64_t pending_ops() const { return engine_.pending(); }
  std::string buffered_reason() const { return engine_.buffered_reason(); }
  std::string backend() const { return engine_.backend(); }
  std::string backend_reason() const { return engine_.backend_reason(); }

  // Returns 0 when async_op, else wait()'s count (upstream's convention).
  int64_t pread(const at::Tensor& buffer, const std::string& filename, bool validate, bool async_op,
                int64_t file_offset) {
    submit_read("aio_handle.pread", buffer, filename, validate, file_offset);
    return async_op ? 0 : wait();
  }

  int64_t pwrite(const at::Tensor& buffer, const std::string& filename, bool validate,
                 bool async_op, int64_t file_offset) {
    submit_write("aio_handle.pwrite", buffer, filename, validate, file_offset);
    return async_op ? 0 : wait();
  }

  // deepspeed_ext's own: an async read or write that returns the request's id, which
  // wait_op(id) waits for alone (upstream has only wait(), for everything submitted).
  int64_t submit_pread(const at::Tensor& b, const std::string& f, int64_t off) {
    return submit_read("aio_handle.submit_pread", b, f, false, off);
  }
  int64_t submit_pwrite(const at::Tensor& b, const std::string& f, int64_t off) {
    return submit_write("aio_handle.submit_pwrite", b, f, false, off);
  }

  // Blocks until request `id` (from submit_pread/submit_pwrite) has finished, not those
  // submitted after it; raises its error. Returns 1, the requests it waited for.
  int64_t wait_op(int64_t id) {
    TORCH_CHECK(id >= 1 && id <= engine_.last_id(), "aio_handle.wait_op: id=", id,
                " was not returned by this handle's submit_pread/submit_pwrite (last id ",
                engine_.last_id(), ")");
    const std::string error = engine_.wait_for(id);
    {
      std::lock_guard<std::mutex> lk(mu_);
      inflight_.erase(id);
      if (engine_.pending() == 0) inflight_.clear();
    }
    TORCH_CHECK(error.empty(), error);
    return 1;
  }

  int64_t sync_pread(const at::Tensor& b, const std::string& f, int64_t off) {
    return pread(b, f, false, false, off);
  }
  int64_t sync_pwrite(const at::Tensor& b, const std::string& f, int64_t off) {
    return pwrite(b, f, false, false, off);
  }
  int64_t async_pread(const at::Tensor& b, const std::string& f, int64_t off) {
    return pread(b, f, false, true, off);
  }
  int64_t async_pwrite(const at::Tensor& b, const std::string& f, int64_t off) {
    return pwrite(b, f, false, true, off);
  }
  int64_t read(const at::Tensor& b, const std::string& f, bool validate, int64_t off) {
    return pread(b, f, validate, false, off);
  }
  int64_t write(const at::Tensor& b, const std::string& f, bool validate, int64_t off) {
    return pwrite(b, f, validate, false, off);
  }

  // Completes every submitted op; returns how many finished, or raises the first error
  // (after all of them finished: no I/O is left running into a buffer).
  int64_t wait() {
    const ds::aio::WaitResult r = engine_.wait();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (engine_.pending() == 0) inflight_.clear();  // else a racing submit still needs them
    }
    TORCH_CHECK(r.error.empty(), r.error);
    return r.completed;
  }

  // A 1-D tensor of num_elem elements of example's dtype whose memory starts on a page
  // (O_DIRECT without a bounce copy); page-locked when a CUDA runtime is present.
  at::Tensor new_cpu_locked_tensor(int64_t num_elem, const at::Tensor& example) {
    constexpr const char* op = "aio_handle.new_cpu_locked_tensor";
    TORCH_CHECK(num_elem >= 0, op, ": num_elem=", num_elem, " must be >= 0");
    TORCH_CHECK(example.defined(), op, ": example_tensor is undefined");
    const auto opts = at::TensorOptions().dtype(example.scalar_type());
    if (at::hasCUDA()) {
      at::Tensor t = at::empty({num_elem}, opts.pinned_memory(true));
      if (ds::aio::is_aligned(t.const_data_ptr())) return track(t);
    }
    const int64_t nbytes = num_elem * int64_t(example.element_size());
    void* p = ds::aio::aligned_alloc_bytes(nbytes);
    TORCH_CHECK(p != nullptr, op, ": cannot allocate ", nbytes, " bytes");
    return track(at::from_blob(p, {num_elem}, [](void* q) { std::free(q); }, opts));
  }

  // True when `t` came from new_cpu_locked_tensor of this handle. Its memory is released
  // when the last reference to it goes, never under a live tensor.
  bool free_cpu_locked_tensor(const at::Tensor& t) {
    std::lock_guard<std::mutex> lk(mu_);
    return t.defined() && locked_.erase(t.const_data_ptr()) > 0;
  }

 private:
  int64_t submit_read(const char* op, const at::Tensor& buffer, const std::string& filename,
                      bool validate, int64_t file_offset) {
    check_buffer(buffer, op);
    check_file_args(filename, file_offset, op);
    check_readable(filename, file_offset, int64_t(buffer.nbytes()), op);
    return submit(true, buffer, static_cast<char*>(buffer.mutable_data_ptr()), filename, validate,
                  file_offset);
  }

  int64_t submit_write(const char* op, const at::Tensor& buffer, const std::string& filename,
                       bool validate, int64_t file_offset) {
    check_buffer(buffer, op);
    check_file_args(filename, file_offset, op);
    check_writable(filename, op);
    // The core's buffer pointer is not const; a write never stores through it.
    char* mem = static_cast<char*>(const_cast<void*>(buffer.const_data_ptr()));
    return submit(false, buffer, mem, filename, validate, file_offset);
  }

  int64_t submit(bool read, const at::Tensor& buffer, char* mem, const std::string& f,
                 bool validate, int64_t off) {
    std::lock_guard<std::mutex> lk(mu_);
    // Kept alive until waited for; entered first, as the I/O may start at once. Every submit
    // goes through here under mu_, so the engine's next id is last_id() + 1.
    const int64_t next = engine_.last_id() + 1;
    inflight_[next] = buffer;
    try {
      const int64_t id = engine_.submit({read, f, mem, int64_t(buffer.nbytes()), off, validate});
      TORCH_INTERNAL_ASSERT(id == next, "aio_handle: request id ", id, ", expected ", next);
      return id;
    } catch (...) {
      inflight_.erase(next);
      throw;
    }
  }

  at::Tensor track(at::Tensor t) {
    std::lock_guard<std::mutex> lk(mu_);
    locked_.insert(t.const_data_ptr());
    return t;
  }

  std::mutex mu_;  // guards inflight_ and locked_
  // Buffers of submitted ops by id. Declared before engine_, so they outlive it: engine_ is
  // destroyed first and finishes the in-flight I/O into them.
  std::unordered_map<int64_t, at::Tensor> inflight_;
  std::unordered_set<const void*> locked_;  // data pointers from new_cpu_locked_tensor
  ds::aio::Engine engine_;
};

c10::intrusive_ptr<AioHandle> aio_handle(int64_t block_size, int64_t queue_depth,
                                         bool single_submit, bool overlap_events,
                                         int64_t intra_op_parallelism) {
  return c10::make_intrusive<AioHandle>(block_size, queue_depth, single_submit, overlap_events,
                                        intra_op_parallelism);
}

}  // namespace

TORCH_LIBRARY(ds_async_io, m) {
  using torch::arg;
  using H = AioHandle;
  m.class_<H>("AioHandle")
      .def("get_block_size", &H::get_block_size)
      .def("get_queue_depth", &H::get_queue_depth)
      .def("get_single_submit", &H::get_single_submit)
      .def("get_overlap_events", &H::get_overlap_events)
      .def("get_intra_op_parallelism", &H::get_intra_op_parallelism)
      .def("get_alignment", &H::get_alignment)
      .def("get_thread_count", &H::get_thread_count)
      .def("pending_ops", &H::pending_ops)
      .def("buffered_reason", &H::buffered_reason)
      .def("backend", &H::backend)
      .def("backend_reason", &H::backend_reason)
      .def("pread", &H::pread, "",
           {arg("buffer"), arg("filename"), arg("validate"), arg("async_op"),
            arg("file_offset") = int64_t(0)})
      .def("pwrite", &H::pwrite, "",
           {arg("buffer"), arg("filename"), arg("validate"), arg("async_op"),
            arg("file_offset") = int64_t(0)})
      .def("read", &H::read, "",
           {arg("buffer"), arg("filename"), arg("validate"), arg("file_offset") = int64_t(0)})
      .def("write", &H::write, "",
           {arg("buffer"), arg("filename"), arg("validate"), arg("file_offset") = int64_t(0)})
      .def("sync_pread", &H::sync_pread, "",
           {arg("buffer"), arg("filename"), arg("file_offset") = int64_t(0)})
      .def("sync_pwrite", &H::sync_pwrite, "",
           {arg("buffer"), arg("filename"), arg("file_offset") = int64_t(0)})
      .def("async_pread", &H::async_pread, "",
           {arg("buffer"), arg("filename"), arg("file_offset") = int64_t(0)})
      .def("async_pwrite", &H::async_pwrite, "",
           {arg("buffer"), arg("filename"), arg("file_offset") = int64_t(0)})
      .def("submit_pread", &H::submit_pread, "",
           {arg("buffer"), arg("filename"), arg("file_offset") = int64_t(0)})
      .def("submit_pwrite", &H::submit_pwrite, "",
           {arg("buffer"), arg("filename"), arg("file_offset") = int64_t(0)})
      .def("wait_op", &H::wait_op)
      .def("wait", &H::wait)
      .def("new_cpu_locked_tensor", &H::new_cpu_locked_tensor, "",
           {arg("num_elem"), arg("example_tensor")})
      .def("free_cpu_locked_tensor", &H::free_cpu_locked_tensor);
  m.def(
      "aio_handle(int block_size=1048576, int queue_depth=8, bool single_submit=False, "
      "bool overlap_events=False, int intra_op_parallelism=1) "
      "-> __torch__.torch.classes.ds_async_io.AioHandle",
      &aio_handle);
}
