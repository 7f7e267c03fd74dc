// Fused multi-tensor Lion for CUDA: the torch-free kernel core.
//
// [Note: fused lion math]
// Per element, in fp32, as the Lion paper's Algorithm 2 (Chen et al. 2023) and the CPU op:
//   c = beta1 * m + (1 - beta1) * g          (the update direction)
//   p *= 1 - lr * weight_decay               (decoupled weight decay)
//   p -= lr * sign(c)                        (sign(0) = 0)
//   m = beta2 * m + (1 - beta2) * g          (the stored momentum)
// Params are fp32, fp16 or bf16; grads fp32 or the param dtype; exp_avg fp32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dtype.h"

namespace ds {

struct FusedLionParams {
  float lr = 1e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float weight_decay = 0.f;
};

// n tensors; entry i of every list belongs to tensor i, all with numel[i] elements, on the
// current device. The pointer arrays live in host memory.
struct FusedLionTensors {
  int n = 0;
  void* const* params = nullptr;
  void* const* grads = nullptr;     // read only
  void* const* exp_avgs = nullptr;  // fp32
  const int64_t* numel = nullptr;
};

// True for the dtype pairs the kernel has: grads fp32 or the param dtype.
bool fused_lion_supports(DType param, DType grad);

// Enqueues the update of all tensors on `stream`; all params share one dtype and all grads
// another. cudaErrorInvalidValue for an unsupported pair, else the launch status.
cudaError_t launch_fused_lion(const FusedLionParams& hp, const FusedLionTensors& tensors,
                              DType param_dtype, DType grad_dtype, cudaStream_t stream);

}  // namespace ds
