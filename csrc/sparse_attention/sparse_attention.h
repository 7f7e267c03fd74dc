// Torch-free CPU kernels of block-sparse attention ([Note: block-sparse kernels]).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace ds {

// A layout's non-zero blocks, compressed once per layout ([Note: block-sparse kernels]).
// Block z is (head, row, col) = blocks[3z .. 3z+2], in the layout's (head, row, col) order,
// which is also the order of a sparse tensor's [batch, nnz, block, block] blocks.
// row_ptr/row_idx list the blocks of each (head, block row) by column; col_ptr/col_idx the
// blocks of each (head, block column) by row. Both pointers have heads * nb + 1 entries.
struct BlockLut {
  const int32_t* blocks;
  const int32_t* row_ptr;
  const int32_t* row_idx;
  const int32_t* col_ptr;
  const int32_t* col_idx;
  int64_t nnz;
  int64_t heads;
  int64_t nb;     // blocks per side
  int64_t block;  // block size
};

// A dense operand read as a logical matrix per (batch, head): element (i, k) of (b, h) is at
// p[b * sb + h * sh + i * si + k * sk] (element strides). Swapping si and sk transposes it.
struct DenseView {
  const void* p;
  int64_t sb, sh, si, sk;
};

// sdd: out[b, z] = A[b, h](rows of block r) @ B[b, h](columns of block c), for blocks z in
// [z0, z1) of the flattened (batch, nnz) range; A is logically [nb*block, K], B [K, nb*block].
void bsr_sdd(DType t, const BlockLut& lut, const DenseView& a, const DenseView& b, int64_t k,
             void* out, int64_t z0, int64_t z1);

// dsd: out[b, h] (contiguous [nb*block, n]) = S[b] @ B[b, h], S the sparse operand
// ([batch, nnz, block, block]; trans_s: its transpose), B logically [nb*block, n]. Work
// items [w0, w1) over (batch, head, output block row).
void bsr_dsd(DType t, const BlockLut& lut, const void* s, bool trans_s, const DenseView& b,
             int64_t n, void* out, int64_t w0, int64_t w1);

// dds: out[b, h] (contiguous [m, nb*block]) = A[b, h] @ S[b] (trans_s: its transpose), A
// logically [m, nb*block]. Work items [w0, w1) over (batch, head, output block column).
void bsr_dds(DType t, const BlockLut& lut, const DenseView& a, int64_t m, const void* s,
             bool trans_s, void* out, int64_t w0, int64_t w1);

// Additive terms of the softmax, fp32, any may be null: rpe[b, h, i, j] at rpe + b * rpe_sb +
// h * rpe_sh + i * rpe_si + j; key padding kp[b, j] at kp + b * kp_sb + j; attn[i, j] at
// attn + i * attn_si + j.
struct SoftmaxTerms {
  const float* rpe;
  int64_t rpe_sb, rpe_sh, rpe_si;
  const float* kp;
  int64_t kp_sb;
  const float* attn;
  int64_t attn_si;
};

// Row-wise softmax of x * scale + terms over each row's non-zero blocks; a row with every
// entry at -inf gives zeros. Work items [w0, w1) over (batch, head, block row).
void bsr_softmax_fwd(DType t, const BlockLut& lut, const void* x, void* y, float scale,
                     const SoftmaxTerms& terms, int64_t w0, int64_t w1);
// dx = scale * y * (dy - sum(y * dy)) per row.
void bsr_softmax_bwd(DType t, const BlockLut& lut, const void* y, const void* dy, void* dx,
                     float scale, int64_t w0, int64_t w1);

}  // namespace ds
