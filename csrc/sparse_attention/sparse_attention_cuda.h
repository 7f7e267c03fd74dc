// Torch-free CUDA launchers of block-sparse attention ([Note: block-sparse CUDA kernels]):
// the contracts of sparse_attention.h's CPU kernels, over whole tensors, on `stream`. The
// BlockLut's pointers are device pointers. Each returns the launch's error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dtype.h"
#include "sparse_attention.h"

namespace ds {

// Block sizes the kernels are instantiated for.
bool bsr_cuda_block_ok(int64_t block);

cudaError_t bsr_sdd_cuda(DType t, const BlockLut& lut, const DenseView& a, const DenseView& b,
                         int64_t k, void* out, int64_t batch, cudaStream_t stream);
cudaError_t bsr_dsd_cuda(DType t, const BlockLut& lut, const void* s, bool trans_s,
                         const DenseView& b, int64_t n, void* out, int64_t batch,
                         cudaStream_t stream);
cudaError_t bsr_dds_cuda(DType t, const BlockLut& lut, const DenseView& a, int64_t m, const void* s,
                         bool trans_s, void* out, int64_t batch, cudaStream_t stream);
// One warp per query row of each (batch, head, block row): batch * heads * nb * block rows.
cudaError_t bsr_softmax_fwd_cuda(DType t, const BlockLut& lut, const void* x, void* y, float scale,
                                 const SoftmaxTerms& terms, int64_t batch, cudaStream_t stream);
cudaError_t bsr_softmax_bwd_cuda(DType t, const BlockLut& lut, const void* y, const void* dy,
                                 void* dx, float scale, int64_t batch, cudaStream_t stream);

}  // namespace ds
