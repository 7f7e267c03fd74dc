// Input checks shared by the CPU and CUDA packbits bindings ([Note: sign packing]).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cmath>

#include "dtype.h"

namespace ds_bind {

inline int64_t packed_bytes(int64_t n) { return (n + 7) / 8; }

inline ds::DType value_dtype(const at::Tensor& x, const char* op) {
  switch (x.scalar_type()) {
    case at::kFloat: return ds::DType::kFloat32;
    case at::kBFloat16: return ds::DType::kBFloat16;
    case at::kHalf: return ds::DType::kFloat16;
    default:
      TORCH_CHECK(false, op, ": x has dtype ", x.scalar_type(),
                  "; expected float32, bfloat16 or float16");
  }
}

inline void check_on(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", arg, " is on ", t.device(), " but x is on ",
              x.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, " is not contiguous");
}

inline void check_values(const at::Tensor& x, bool cuda, const char* op) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  TORCH_CHECK(cuda ? x.is_cuda() : x.device().is_cpu(), op, ": x is on ", x.device(),
              cuda ? "; this op runs on CUDA tensors" : "; this op runs on CPU tensors");
  TORCH_CHECK(x.is_contiguous(), op, ": x is not contiguous");
  value_dtype(x, op);
}

inline void check_error(const c10::optional<at::Tensor>& err, const at::Tensor& x, const char* op) {
  if (!err.has_value()) return;
  check_on(*err, x, op, "err");
  TORCH_CHECK(err->scalar_type() == at::kFloat, op, ": err has dtype ", err->scalar_type(),
              "; error-feedback buffers are float32");
  TORCH_CHECK(err->numel() == x.numel(), op, ": err has ", err->numel(), " elements but x has ",
              x.numel());
}

inline void check_bits(const at::Tensor& bits, const at::Tensor& like, int64_t n, const char* op) {
  check_on(bits, like, op, "bits");
  TORCH_CHECK(bits.scalar_type() == at::kByte, op, ": bits has dtype ", bits.scalar_type(),
              "; expected uint8");
  TORCH_CHECK(bits.numel() == packed_bytes(n), op, ": bits has ", bits.numel(), " bytes; ", n,
              " elements pack into ", packed_bytes(n));
}

// the scale is a one-element float32 tensor beside the data (on a GPU it never syncs)
inline void check_scale(const at::Tensor& scale, const at::Tensor& like, const char* op) {
  check_on(scale, like, op, "scale");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, op,
              ": scale must be a one-element float32 tensor, got ", scale.scalar_type(), " with ",
              scale.numel(), " elements");
}

inline void check_scale_value(double scale, const char* op) {
  TORCH_CHECK(std::isfinite(scale) && scale >= 0, op, ": scale is ", scale,
              "; expected a finite value >= 0");
}

inline void check_out(const at::Tensor& out, const at::Tensor& bits, const char* op) {
  check_on(out, bits, op, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, op, ": out has dtype ", out.scalar_type(),
              "; expected float32");
}

}  // namespace ds_bind
