// Shared input checks and parallel driver for the CPU optimizer bindings (cpu_adam,
// cpu_adagrad, cpu_lion). Bindings only: this header sees at::Tensor, the kernels never do.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "cpu_chunks.h"
#include "dtype.h"

namespace ds_bind {

struct OptTensor {
  void* p;
  const void* g;
  void* s1;
  void* s2;  // nullptr for single-state optimizers
  int64_t n;
  ds::DType pt, gt, st;
};

inline ds::DType to_dtype(const at::Tensor& t, const char* op, const char* arg, size_t i) {
  switch (t.scalar_type()) {
    case at::kFloat: return ds::DType::kFloat32;
    case at::kBFloat16: return ds::DType::kBFloat16;
    case at::kHalf: return ds::DType::kFloat16;
    default:
      TORCH_CHECK(false, op, ": ", arg, "[", i, "] has dtype ", t.scalar_type(),
                  "; expected float32, bfloat16 or float16");
  }
}

inline void check_tensor(const at::Tensor& t, const char* op, const char* arg, size_t i,
                         int64_t numel) {
  TORCH_CHECK(t.defined(), op, ": ", arg, "[", i, "] is undefined (a parameter without .grad?)");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", arg, "[", i, "] is on ", t.device(),
              "; this op runs on CPU tensors only");
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, "[", i, "] is not contiguous");
  TORCH_CHECK(!t.is_sparse(), op, ": ", arg, "[", i, "] is sparse; dense tensors only");
  TORCH_CHECK(t.numel() == numel, op, ": ", arg, "[", i, "] has ", t.numel(),
              " elements but params[", i, "] has ", numel);
}

inline void check_len(at::TensorList l, size_t n, const char* op, const char* arg) {
  TORCH_CHECK(l.size() == n, op, ": ", arg, " has ", l.size(), " tensors but params has ", n);
}

// Validates the lists and flattens them into kernel-ready pointers.
inline std::vector<OptTensor> check_lists(const char* op, at::TensorList params,
                                          at::TensorList grads, at::TensorList s1,
                                          const char* s1_name, const at::TensorList* s2,
                                          const char* s2_name) {
  const size_t n = params.size();
  check_len(grads, n, op, "grads");
  check_len(s1, n, op, s1_name);
  if (s2) check_len(*s2, n, op, s2_name);
  std::vector<OptTensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), op, ": params[", i, "] is undefined");
    const int64_t numel = p.numel();
    check_tensor(p, op, "params", i, numel);
    check_tensor(grads[i], op, "grads", i, numel);
    check_tensor(s1[i], op, s1_name, i, numel);
    OptTensor t{p.data_ptr(),
                grads[i].const_data_ptr(),
                s1[i].data_ptr(),
                nullptr,
                numel,
                to_dtype(p, op, "params", i),
                to_dtype(grads[i], op, "grads", i),
                to_dtype(s1[i], op, s1_name, i)};
    TORCH_CHECK(t.st == t.pt || t.st == ds::DType::kFloat32, op, ": ", s1_name, "[", i, "] is ",
                ds::dtype_name(t.st),
                "; optimizer states must be float32 or match "
                "the params (",
                ds::dtype_name(t.pt), ")");
    if (s2) {
      const at::Tensor& q = (*s2)[i];
      check_tensor(q, op, s2_name, i, numel);
      TORCH_CHECK(q.scalar_type() == s1[i].scalar_type(), op, ": ", s2_name, "[", i, "] dtype ",
                  q.scalar_type(), " differs from ", s1_name, "[", i, "] dtype ",
                  s1[i].scalar_type());
      t.s2 = q.data_ptr();
    }
    out.push_back(t);
  }
  return out;
}

inline void check_range(double v, double lo, double hi, bool hi_open, const char* op,
                        const char* name) {
  const bool ok = v >= lo && (hi_open ? v < hi : v <= hi);
  TORCH_CHECK(ok, op, ": ", name, "=", v, " is out of range ", "[", lo, ", ", hi,
              hi_open ? ")" : "]");
}

template <class T>
inline T* at_elem(T* base, ds::DType t, int64_t i) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(base) + i * int64_t(ds::dtype_size(t)));
}

// Runs f(tensor, begin, count) over equal chunks of all tensors on torch's thread pool.
template <class F>
inline void run_chunked(const std::vector<OptTensor>& ts, F&& f) {
  std::vector<int64_t> numels;
  numels.reserve(ts.size());
  for (const auto& t : ts) numels.push_back(t.n);
  const std::vector<ds::Chunk> chunks = ds::make_chunks(numels);
  at::parallel_for(0, int64_t(chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const ds::Chunk& ch = chunks[size_t(c)];
      f(ts[size_t(ch.tensor)], ch.begin, ch.end - ch.begin);
    }
  });
}

}  // namespace ds_bind
