// Adam / AdamW step on the CPU: torch-free core.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace ds {

struct AdamParams {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based step of these tensors, for bias correction
  bool bias_correction;
  bool adamw_mode;  // decoupled weight decay (AdamW) instead of L2 added to the gradient
};

// Updates n elements in place. Returns false for an unsupported dtype combination
// (params P; grads P or fp32; states fp32 or P).
bool adam_update(const AdamParams& hp, DType p_t, void* p, DType g_t, const void* g, DType s_t,
                 void* exp_avg, void* exp_avg_sq, int64_t n);

}  // namespace ds
