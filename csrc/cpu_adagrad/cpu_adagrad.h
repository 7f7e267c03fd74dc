// Adagrad step on the CPU: torch-free core.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace ds {

struct AdagradParams {
  double lr, eps, weight_decay;  // weight decay is L2, added to the gradient (as torch)
};

bool adagrad_update(const AdagradParams& hp, DType p_t, void* p, DType g_t, const void* g,
                    DType s_t, void* exp_avg_sq, int64_t n);

}  // namespace ds
