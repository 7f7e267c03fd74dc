// Lion step on the CPU: torch-free core.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace ds {

struct LionParams {
  double lr, beta1, beta2, weight_decay;  // decoupled weight decay, as in the Lion paper
};

bool lion_update(const LionParams& hp, DType p_t, void* p, DType g_t, const void* g, DType s_t,
                 void* exp_avg, int64_t n);

}  // namespace ds
