// Fused multi-tensor LAMB for CUDA: the torch-free kernel core.
//
// [Note: lamb math]
// The semantics of upstream DeepSpeed's FusedLamb (csrc/lamb/fused_lamb_cuda_kernel.cu and
// deepspeed/ops/lamb/fused_lamb.py), pinned here because they differ from the LAMB paper
// and from apex's FusedLAMB in several places. Per tensor, in fp32, at step t:
//
//   g     = grad / grad_scale
//   m     = beta1 * m + (1 - beta1) * g
//   v     = beta2 * v + (1 - beta2) * g * g
//   denom = sqrt(v + eps)   if eps_inside_sqrt
//           sqrt(v) + eps   otherwise (the default)
//   u     = m / denom + weight_decay * p
//   w_norm = ||p||_2, u_norm = ||u||_2               (p before this step's update)
//   coeff = clamp(w_norm / u_norm, min_coeff, max_coeff)  if w_norm != 0 and u_norm != 0
//           1                                             otherwise
//   step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)   with bias correction, else lr
//   p     = p - step_size * coeff * u
//
// Points that matter:
//  - eps is added to the *uncorrected* sqrt(v) (or v); bias correction lives only in
//    step_size. So with bias correction the update is not m_hat / (sqrt(v_hat) + eps).
//  - Weight decay does not enter the moments: it is added to the update, is counted in
//    u_norm, and is scaled by step_size * coeff like the rest of the update.
//  - u_norm is the norm of u, without step_size.
//  - The clamp tests max first, then min, so min_coeff wins if min_coeff > max_coeff.
//    A NaN or inf norm passes the != 0 test and gives a NaN coeff, as upstream.
//  - grad_scale is the "combined scale" the Python face computes (loss scale, raised by
//    gradient clipping): with max_grad_norm > 0 and a given grad norm (the norm of the
//    still-scaled grads), clip = (grad_norm / scale + 1e-6) / max_grad_norm and
//    grad_scale = clip * scale if clip > 1, else scale. The kernel only divides by it.
//  - Per-tensor trust ratio: a tensor's coeff depends on that tensor alone.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dtype.h"

namespace ds {

struct FusedLambParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.f;
  float grad_scale = 1.f;
  float max_coeff = 10.f;
  float min_coeff = 0.01f;
  int64_t step = 1;  // 1-based; used only for bias correction
  bool bias_correction = true;
  bool eps_inside_sqrt = false;
};

// n tensors; entry i of every list belongs to tensor i. Pointer arrays live in host memory,
// the pointers are device addresses on the current device.
struct FusedLambTensors {
  int n = 0;
  void* const* params = nullptr;
  void* const* grads = nullptr;        // read only
  void* const* exp_avgs = nullptr;     // fp32
  void* const* exp_avg_sqs = nullptr;  // fp32
  void* const* coeffs = nullptr;       // one float each: receives the tensor's trust ratio
  const int64_t* numel = nullptr;
};

// True for the dtype pairs the kernel has: grads fp32 or the param dtype, and any grad
// dtype for fp32 params (upstream's mixed precision: fp16 grads, fp32 master params).
bool fused_lamb_supports(DType param, DType grad);

// Floats of device workspace launch_fused_lamb needs for these tensor sizes (two partial
// sums per chunk). The same workspace may be reused by later calls on the same stream.
int64_t fused_lamb_workspace_floats(int n, const int64_t* numel);

// Enqueues the LAMB step of all tensors on `stream`: per table of tensors, phase 1 (moments,
// update, per-chunk partial norms), a per-tensor reduction that writes coeffs, and phase 2
// (apply the update with the trust ratio). All params share one dtype, all grads another.
cudaError_t launch_fused_lamb(const FusedLambParams& hp, const FusedLambTensors& tensors,
                              DType param_dtype, DType grad_dtype, float* workspace,
                              cudaStream_t stream);

}  // namespace ds
