// CPU kernels of block-sparse attention ([Note: block-sparse kernels]).
//
// [Note: block-sparse kernels]
// Attention restricted to a block layout: only the non-zero blocks of the score matrix are
// computed (sdd: dense x dense -> sparse), normalized (a softmax over each row's non-zero
// blocks) and used (dsd: sparse x dense -> dense; dds: dense x sparse -> dense, which the
// backward needs). Time and memory follow the number of non-zero blocks, not the sequence
// length squared. The layout is compressed once (BlockLut: the blocks in order, and the
// blocks of each block row and each block column), so each work item (one output block, block
// row or block column) finds its blocks without scanning the layout. Work items write disjoint
// outputs, so they run in parallel without atomics. Operands are packed into fp32 tiles, and
// the inner loops run over contiguous fp32 with the op's SIMD level; storage may be fp32,
// bf16 or fp16.
#include "sparse_attention/sparse_attention.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fast_math.h"
#include "half.h"

namespace ds {
namespace {

template <class T>
inline float at(const DenseView& v, int64_t b, int64_t h, int64_t i, int64_t k) {
  return to_float(static_cast<const T*>(v.p)[b * v.sb + h * v.sh + i * v.si + k * v.sk]);
}

// c[m][n] += sum_k a[m][k] * b[k][n] over packed row-major fp32 tiles. Four rows of c and 16
// columns at a time stay in registers across the whole k loop (64 accumulators: four AVX-512
// or eight AVX2 registers), so each loaded b vector feeds four FMAs and c is stored once.
void tile_gemm(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kR = 4, kC = 16;
  int64_t m = 0;
  for (; m + kR <= M; m += kR) {
    int64_t n = 0;
    for (; n + kC <= N; n += kC) {
      float acc[kR][kC] = {};
      for (int64_t k = 0; k < K; ++k) {
        const float* bk = b + k * N + n;
        for (int64_t r = 0; r < kR; ++r) {
          const float x = a[(m + r) * K + k];
#pragma omp simd
          for (int64_t l = 0; l < kC; ++l) acc[r][l] += x * bk[l];
        }
      }
      for (int64_t r = 0; r < kR; ++r)
        for (int64_t l = 0; l < kC; ++l) c[(m + r) * N + n + l] += acc[r][l];
    }
    for (; n < N; ++n)  // columns past the last full vector
      for (int64_t r = 0; r < kR; ++r) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += a[(m + r) * K + k] * b[k * N + n];
        c[(m + r) * N + n] += acc;
      }
  }
  for (; m < M; ++m)  // rows past the last group of four
    for (int64_t k = 0; k < K; ++k) {
      const float x = a[m * K + k];
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) c[m * N + n] += x * b[k * N + n];
    }
}

template <class T>
void sdd(const BlockLut& L, const DenseView& A, const DenseView& B, int64_t K, T* out, int64_t z0,
         int64_t z1) {
  const int64_t bs = L.block;
  // A's rows as ap[i][k]; B's columns as bp[k][j] (j contiguous), so the product is a sum of
  // outer products: acc[i][:] += ap[i][k] * bp[k][:], vector-wide with no horizontal sums.
  std::vector<float> ap(bs * K), bp(K * bs), acc(bs * bs);
  for (int64_t w = z0; w < z1; ++w) {
    const int64_t b = w / L.nnz, z = w % L.nnz;
    const int64_t h = L.blocks[3 * z], r = L.blocks[3 * z + 1], c = L.blocks[3 * z + 2];
    for (int64_t i = 0; i < bs; ++i)
      for (int64_t k = 0; k < K; ++k) ap[i * K + k] = at<T>(A, b, h, r * bs + i, k);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < bs; ++j) bp[k * bs + j] = at<T>(B, b, h, k, c * bs + j);
    std::fill(acc.begin(), acc.end(), 0.f);
    tile_gemm(ap.data(), bp.data(), acc.data(), bs, bs, K);
    T* o = out + w * bs * bs;
    for (int64_t e = 0; e < bs * bs; ++e) from_float(acc[e], o + e);
  }
}

template <class T>
void dsd(const BlockLut& L, const T* S, bool trans_s, const DenseView& B, int64_t N, T* out,
         int64_t w0, int64_t w1) {
  const int64_t bs = L.block, rows_per_head = L.nb;
  std::vector<float> acc(bs * N), bp(bs * N), sp(bs * bs);
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t b = w / (L.heads * rows_per_head);
    const int64_t h = (w / rows_per_head) % L.heads, r = w % rows_per_head;
    std::fill(acc.begin(), acc.end(), 0.f);
    // S's row r is stored row r (blocks by row), or, transposed, stored column r
    const int32_t* ptr = trans_s ? L.col_ptr : L.row_ptr;
    const int32_t* idx = trans_s ? L.col_idx : L.row_idx;
    const int64_t key = h * L.nb + r;
    for (int32_t e = ptr[key]; e < ptr[key + 1]; ++e) {
      const int64_t z = idx[e];
      const int64_t other = trans_s ? L.blocks[3 * z + 1] : L.blocks[3 * z + 2];
      const T* blk = S + (b * L.nnz + z) * bs * bs;
      for (int64_t i = 0; i < bs; ++i)
        for (int64_t k = 0; k < bs; ++k)
          sp[i * bs + k] = to_float(trans_s ? blk[k * bs + i] : blk[i * bs + k]);
      for (int64_t k = 0; k < bs; ++k)
        for (int64_t n = 0; n < N; ++n) bp[k * N + n] = at<T>(B, b, h, other * bs + k, n);
      tile_gemm(sp.data(), bp.data(), acc.data(), bs, N, bs);
    }
    T* o = out + ((b * L.heads + h) * L.nb * bs + r * bs) * N;
    for (int64_t i = 0; i < bs * N; ++i) from_float(acc[i], o + i);
  }
}

template <class T>
void dds(const BlockLut& L, const DenseView& A, int64_t M, const T* S, bool trans_s, T* out,
         int64_t w0, int64_t w1) {
  const int64_t bs = L.block, width = L.nb * bs;
  std::vector<float> acc(M * bs), ap(M * bs), sp(bs * bs);
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t b = w / (L.heads * L.nb);
    const int64_t h = (w / L.nb) % L.heads, c = w % L.nb;
    std::fill(acc.begin(), acc.end(), 0.f);
    // S's column c is stored column c, or, transposed, stored row c
    const int32_t* ptr = trans_s ? L.row_ptr : L.col_ptr;
    const int32_t* idx = trans_s ? L.row_idx : L.col_idx;
    const int64_t key = h * L.nb + c;
    for (int32_t e = ptr[key]; e < ptr[key + 1]; ++e) {
      const int64_t z = idx[e];
      const int64_t other = trans_s ? L.blocks[3 * z + 2] : L.blocks[3 * z + 1];
      const T* blk = S + (b * L.nnz + z) * bs * bs;
      for (int64_t k = 0; k < bs; ++k)
        for (int64_t j = 0; j < bs; ++j)
          sp[k * bs + j] = to_float(trans_s ? blk[j * bs + k] : blk[k * bs + j]);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < bs; ++k) ap[m * bs + k] = at<T>(A, b, h, m, other * bs + k);
      tile_gemm(ap.data(), sp.data(), acc.data(), M, bs, bs);
    }
    T* o = out + (b * L.heads + h) * M * width + c * bs;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < bs; ++j) from_float(acc[m * bs + j], o + m * width + j);
  }
}

template <class T>
void softmax_fwd(const BlockLut& L, const T* x, T* y, float scale, const SoftmaxTerms& t,
                 int64_t w0, int64_t w1) {
  const int64_t bs = L.block;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> row;
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t b = w / (L.heads * L.nb);
    const int64_t h = (w / L.nb) % L.heads, r = w % L.nb;
    const int64_t key = h * L.nb + r;
    const int32_t e0 = L.row_ptr[key], e1 = L.row_ptr[key + 1];
    row.resize((e1 - e0) * bs);
    for (int64_t i = 0; i < bs; ++i) {
      const int64_t qi = r * bs + i;  // the query's position
      float mx = neg_inf;
      for (int32_t e = e0; e < e1; ++e) {
        const int64_t z = L.row_idx[e], c = L.blocks[3 * z + 2];
        const T* xr = x + ((b * L.nnz + z) * bs + i) * bs;
        float* v = row.data() + (e - e0) * bs;
        for (int64_t j = 0; j < bs; ++j) {
          const int64_t kj = c * bs + j;  // the key's position
          float s = to_float(xr[j]) * scale;
          if (t.rpe != nullptr) s += t.rpe[b * t.rpe_sb + h * t.rpe_sh + qi * t.rpe_si + kj];
          if (t.kp != nullptr) s += t.kp[b * t.kp_sb + kj];
          if (t.attn != nullptr) s += t.attn[qi * t.attn_si + kj];
          v[j] = s;
          mx = s > mx ? s : mx;
        }
      }
      const int64_t n = (e1 - e0) * bs;
      softmax_row(row.data(), n, mx);
      for (int32_t e = e0; e < e1; ++e) {
        const int64_t z = L.row_idx[e];
        T* yr = y + ((b * L.nnz + z) * bs + i) * bs;
        for (int64_t j = 0; j < bs; ++j) from_float(row[(e - e0) * bs + j], yr + j);
      }
    }
  }
}

template <class T>
void softmax_bwd(const BlockLut& L, const T* y, const T* dy, T* dx, float scale, int64_t w0,
                 int64_t w1) {
  const int64_t bs = L.block;
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t b = w / (L.heads * L.nb);
    const int64_t h = (w / L.nb) % L.heads, r = w % L.nb;
    const int64_t key = h * L.nb + r;
    for (int64_t i = 0; i < bs; ++i) {
      float dot = 0.f;
      for (int32_t e = L.row_ptr[key]; e < L.row_ptr[key + 1]; ++e) {
        const int64_t off = ((b * L.nnz + L.row_idx[e]) * bs + i) * bs;
        for (int64_t j = 0; j < bs; ++j) dot += to_float(y[off + j]) * to_float(dy[off + j]);
      }
      for (int32_t e = L.row_ptr[key]; e < L.row_ptr[key + 1]; ++e) {
        const int64_t off = ((b * L.nnz + L.row_idx[e]) * bs + i) * bs;
        for (int64_t j = 0; j < bs; ++j) {
          const float yv = to_float(y[off + j]);
          from_float(scale * yv * (to_float(dy[off + j]) - dot), dx + off + j);
        }
      }
    }
  }
}

}  // namespace

void bsr_sdd(DType t, const BlockLut& lut, const DenseView& a, const DenseView& b, int64_t k,
             void* out, int64_t z0, int64_t z1) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    sdd<T>(lut, a, b, k, static_cast<T*>(out), z0, z1);
  });
}

void bsr_dsd(DType t, const BlockLut& lut, const void* s, bool trans_s, const DenseView& b,
             int64_t n, void* out, int64_t w0, int64_t w1) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dsd<T>(lut, static_cast<const T*>(s), trans_s, b, n, static_cast<T*>(out), w0, w1);
  });
}

void bsr_dds(DType t, const BlockLut& lut, const DenseView& a, int64_t m, const void* s,
             bool trans_s, void* out, int64_t w0, int64_t w1) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dds<T>(lut, a, m, static_cast<const T*>(s), trans_s, static_cast<T*>(out), w0, w1);
  });
}

void bsr_softmax_fwd(DType t, const BlockLut& lut, const void* x, void* y, float scale,
                     const SoftmaxTerms& terms, int64_t w0, int64_t w1) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_fwd<T>(lut, static_cast<const T*>(x), static_cast<T*>(y), scale, terms, w0, w1);
  });
}

void bsr_softmax_bwd(DType t, const BlockLut& lut, const void* y, const void* dy, void* dx,
                     float scale, int64_t w0, int64_t w1) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_bwd<T>(lut, static_cast<const T*>(y), static_cast<const T*>(dy), static_cast<T*>(dx),
                   scale, w0, w1);
  });
}

}  // namespace ds
