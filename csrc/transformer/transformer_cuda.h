// Torch-free CUDA launchers of the fused transformer layer's kernels
// ([Note: transformer kernels]); the same contracts as transformer.h's CPU kernels, over whole
// tensors, on `stream`. Each returns the launch's error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dtype.h"
#include "transformer.h"

namespace ds {

// dgamma_part / dbeta_part: fp32 [parts, h] partial sums (parts = layer_norm_bwd_parts(rows)),
// which the caller adds up over parts.
int64_t layer_norm_bwd_parts(int64_t rows);

cudaError_t layer_norm_fwd_cuda(DType t, const void* x, const void* gamma, const void* beta,
                                void* y, float* mean, float* rstd, int64_t rows, int64_t h,
                                float eps, cudaStream_t stream);
cudaError_t layer_norm_bwd_cuda(DType t, const void* dy, const void* src, bool src_is_output,
                                const void* gamma, const void* beta, const float* mean,
                                const float* rstd, void* dx, float* dgamma_part, float* dbeta_part,
                                int64_t rows, int64_t h, cudaStream_t stream);
cudaError_t bias_gelu_fwd_cuda(DType t, const void* x, const void* bias, void* y, int64_t numel,
                               int64_t n, cudaStream_t stream);
cudaError_t bias_gelu_bwd_cuda(DType t, const void* dy, const void* x, const void* bias, void* dx,
                               int64_t numel, int64_t n, cudaStream_t stream);
cudaError_t bias_dropout_residual_cuda(DType t, const void* x, const void* bias,
                                       const void* residual, void* out, float p, uint64_t seed,
                                       uint64_t offset, int64_t numel, int64_t n,
                                       cudaStream_t stream);
cudaError_t dropout_cuda(DType t, const void* x, void* out, float p, uint64_t seed, uint64_t offset,
                         int64_t numel, cudaStream_t stream);
cudaError_t softmax_fwd_cuda(DType t, const void* scores, const float* mask, void* probs,
                             float scale, const SoftmaxShape& s, int64_t rows, cudaStream_t stream);
cudaError_t softmax_bwd_cuda(DType t, const void* dprobs, const void* probs, void* dscores,
                             float scale, int64_t sk, int64_t rows, cudaStream_t stream);

}  // namespace ds
