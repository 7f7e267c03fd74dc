// Sign compression kernels for CUDA: torch-free launchers ([Note: sign packing] in
// packbits.h for the bit layout and the error-feedback rule, the same on both devices).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dtype.h"

namespace ds {

// *out (device, double) = sum over [0, n) of (x + err)^2; err may be nullptr
cudaError_t launch_sum_squares(DType t, const void* x, const float* err, int64_t n, double* out,
                               cudaStream_t stream);

// bits of y = x + err; with err, err := y - (*scale) * sign(y). scale lives on the device.
cudaError_t launch_pack_signs(DType t, const void* x, float* err, const float* scale, uint8_t* bits,
                              int64_t n, cudaStream_t stream);

// out[i] = (accumulate ? out[i] : 0) + (bit i ? *scale : -*scale)
cudaError_t launch_unpack_signs(const uint8_t* bits, const float* scale, float* out, int64_t n,
                                bool accumulate, cudaStream_t stream);

}  // namespace ds
