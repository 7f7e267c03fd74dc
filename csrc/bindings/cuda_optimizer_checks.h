// Shared input checks of the CUDA optimizer bindings (fused_adam, fused_lamb). Bindings only:
// this header sees at::Tensor; the kernels never do.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

#include "dtype.h"

namespace ds_bind_cuda {

inline ds::DType to_dtype(at::ScalarType t) {
  if (t == at::kHalf) return ds::DType::kFloat16;
  if (t == at::kBFloat16) return ds::DType::kBFloat16;
  return ds::DType::kFloat32;  // callers pass only checked dtypes
}

inline void check_tensor(const char* op, const at::Tensor& t, const char* name, size_t i,
                         const at::Tensor& p0, const at::Tensor& p) {
  TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
  TORCH_CHECK(t.is_cuda(), op, ": ", name, "[", i, "] must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == p0.device(), op, ": ", name, "[", i, "] is on ", t.device(),
              " but params[0] is on ", p0.device(), "; all tensors must share one device");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous");
  TORCH_CHECK(t.numel() == p.numel(), op, ": ", name, "[", i, "] has ", t.numel(),
              " elements but params[", i, "] has ", p.numel());
}

// params/grads/exp_avgs/exp_avg_sqs[i]: defined, CUDA on params[0]'s device, contiguous,
// equal sizes; params float32/float16/bfloat16. Grad dtypes are each op's own rule.
inline void check_optimizer_tensors(const char* op, at::TensorList params, at::TensorList grads,
                                    at::TensorList exp_avgs, at::TensorList exp_avg_sqs, size_t i) {
  const at::Tensor& p0 = params[0];
  const at::Tensor& p = params[i];
  check_tensor(op, p, "params", i, p0, p);
  check_tensor(op, grads[i], "grads", i, p0, p);
  check_tensor(op, exp_avgs[i], "exp_avgs", i, p0, p);
  check_tensor(op, exp_avg_sqs[i], "exp_avg_sqs", i, p0, p);
  const auto pt = p.scalar_type();
  TORCH_CHECK(pt == at::kFloat || pt == at::kHalf || pt == at::kBFloat16, op, ": params[", i,
              "] must be float32, float16 or bfloat16, got ", pt);
}

inline bool finite_nonneg(double x) { return std::isfinite(x) && x >= 0; }

// The hyperparameters Adam and LAMB share.
inline void check_adam_hyper(const char* op, double lr, double beta1, double beta2, double eps,
                             int64_t step, double weight_decay) {
  TORCH_CHECK(finite_nonneg(lr), op, ": lr must be finite and >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(finite_nonneg(eps), op, ": eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(step >= 1, op, ": step must be >= 1, got ", step);
  TORCH_CHECK(finite_nonneg(weight_decay), op, ": weight_decay must be finite and >= 0, got ",
              weight_decay);
}

}  // namespace ds_bind_cuda
