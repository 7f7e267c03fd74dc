// Torch-free CUDA launchers of fused block-sparse attention ([Note: fused block-sparse
// attention] in sparse_flash.cu): softmax(scale * q k^T restricted to the layout) v, without
// writing the scores. q, k, v, o, dout, dq, dk, dv are contiguous [batch, heads, seq, head_dim]
// of one 16-bit dtype; lse and dvec are fp32 [batch, heads, seq]. The BlockLut's pointers are
// device pointers. Each returns the launch's error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dtype.h"
#include "sparse_attention.h"

namespace ds {

// Whether the fused kernels take this layout block and head size (on sm_80 and later).
bool bsr_flash_ok(int64_t block, int64_t head_dim);

// What else the softmax may take, each null when absent ([Note: fused tile masks]):
// - tile_mask[z], for a table of block 64 only: bit 4 qi + ki of layout block z is set when
//   its 16 x 16 sub-block (queries 16 qi.., keys 16 ki..) is attended to (finer layouts, made
//   coarse);
// - key_bias[b * seq + j]: added to every score of key j in batch b after scaling (a key
//   padding mask as fp32: 0 keeps, -inf drops).
struct FlashExtras {
  const int32_t* tile_mask;
  const float* key_bias;
};

// o and each query's log2-sum-exp of its scaled scores (lse, what the backward needs).
cudaError_t bsr_flash_fwd_cuda(DType t, const BlockLut& lut, const void* q, const void* k,
                               const void* v, void* o, float* lse, int64_t batch, int64_t head_dim,
                               float scale, const FlashExtras& extras, cudaStream_t stream);

// dq, dk, dv from the forward's o and lse; dvec is scratch of lse's size.
cudaError_t bsr_flash_bwd_cuda(DType t, const BlockLut& lut, const void* q, const void* k,
                               const void* v, const void* o, const float* lse, const void* dout,
                               float* dvec, void* dq, void* dk, void* dv, int64_t batch,
                               int64_t head_dim, float scale, const FlashExtras& extras,
                               cudaStream_t stream);

}  // namespace ds
