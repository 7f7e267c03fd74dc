// Fused multi-tensor Adam / AdamW for CUDA: the torch-free kernel core.
//
// [Note: fused adam math]
// Per element, in fp32, with t = step and bc1 = 1 - beta1^t, bc2 = 1 - beta2^t (both 1
// without bias correction), the same update as torch.optim.Adam / torch.optim.AdamW:
//   L2 mode (adam_w_mode false):  g += weight_decay * p
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   denom = sqrt(v) / sqrt(bc2) + eps
//   AdamW mode:                   p *= 1 - lr * weight_decay
//   p -= (lr / bc1) * m / denom
// Params are fp32, fp16 or bf16; grads fp32 or the param dtype; exp_avg and exp_avg_sq fp32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dtype.h"

namespace ds {

struct FusedAdamParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.f;
  int64_t step = 1;  // 1-based; used only for bias correction
  bool adam_w_mode = true;
  bool bias_correction = true;
};

// n tensors; entry i of every list belongs to tensor i, all with numel[i] elements, all on
// the current device. The pointer arrays themselves live in host memory. Untyped pointers,
// so that the lists pack straight into the launch tables; dtypes come separately.
struct FusedAdamTensors {
  int n = 0;
  void* const* params = nullptr;
  void* const* grads = nullptr;        // read only
  void* const* exp_avgs = nullptr;     // fp32
  void* const* exp_avg_sqs = nullptr;  // fp32
  const int64_t* numel = nullptr;
};

// True for the dtype pairs the kernel has: grads fp32 or the param dtype.
bool fused_adam_supports(DType param, DType grad);

// Enqueues the update of all tensors on `stream`. All params share one dtype and all grads
// another. Returns cudaErrorInvalidValue for an unsupported pair, else the launch status.
cudaError_t launch_fused_adam(const FusedAdamParams& hp, const FusedAdamTensors& tensors,
                              DType param_dtype, DType grad_dtype, cudaStream_t stream);

}  // namespace ds
