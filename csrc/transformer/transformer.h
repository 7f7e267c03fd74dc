// Torch-free CPU kernels of the fused transformer layer ([Note: transformer kernels]).
//
// Every kernel works on a range of rows (or of flat elements, for dropout) so the binding can
// split it across threads; math is fp32 whatever the storage type (float, bf16, fp16: DType).
// Pointers are to contiguous row-major storage of the stated type; float* are fp32 buffers.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace ds {

// y = (x - mean) * rstd * gamma + beta over rows of width h; mean/rstd saved per row.
void layer_norm_fwd(DType t, const void* x, const void* gamma, const void* beta, void* y,
                    float* mean, float* rstd, int64_t r0, int64_t r1, int64_t h, float eps);

// dx from dy. `src` is the input x (mean/rstd give x-hat), or, when src_is_output, the output
// y (x-hat = (y - beta) / gamma: the invertible variant, which keeps no input). Adds this row
// range's dgamma/dbeta into the fp32 accumulators of width h.
void layer_norm_bwd(DType t, const void* dy, const void* src, bool src_is_output, const void* gamma,
                    const void* beta, const float* mean, const float* rstd, void* dx, float* dgamma,
                    float* dbeta, int64_t r0, int64_t r1, int64_t h);

// y = gelu(x + bias), tanh approximation, rows of width n.
void bias_gelu_fwd(DType t, const void* x, const void* bias, void* y, int64_t r0, int64_t r1,
                   int64_t n);
// dx = dy * gelu'(x + bias).
void bias_gelu_bwd(DType t, const void* dy, const void* x, const void* bias, void* dx, int64_t r0,
                   int64_t r1, int64_t n);

// out = residual + dropout(x + bias), rows of width n; element (r, j) is dropout index
// offset + r * n + j ([Note: replayed dropout]).
void bias_dropout_residual_fwd(DType t, const void* x, const void* bias, const void* residual,
                               void* out, float p, uint64_t seed, uint64_t offset, int64_t r0,
                               int64_t r1, int64_t n);

// out[i] = x[i] * mask(i) * scale for flat elements [e0, e1): dropout forward, and the
// backward of every dropout (the same call's mask applied to the incoming gradient).
void dropout_apply(DType t, const void* x, void* out, float p, uint64_t seed, uint64_t offset,
                   int64_t e0, int64_t e1);

// The shape of a softmax call: rows of `sk` scores, `rows_per_batch` = heads * sq rows per
// batch entry. mask (fp32, additive, may be null) holds mq rows of sk per batch entry:
// mq == 1 (a key mask shared by every query) or mq == sq (one row per query).
struct SoftmaxShape {
  int64_t sk;
  int64_t sq;
  int64_t rows_per_batch;
  int64_t mq;
};

// probs = softmax(scores * scale + mask) per row; a row with every key masked to -inf gives
// zeros rather than NaN.
void softmax_fwd(DType t, const void* scores, const float* mask, void* probs, float scale,
                 const SoftmaxShape& s, int64_t r0, int64_t r1);
// dscores = scale * probs * (dprobs - sum(dprobs * probs)) per row.
void softmax_bwd(DType t, const void* dprobs, const void* probs, void* dscores, float scale,
                 int64_t sk, int64_t r0, int64_t r1);

}  // namespace ds
