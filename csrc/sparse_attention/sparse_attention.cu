// CUDA kernels of block-sparse attention ([Note: block-sparse CUDA kernels]).
//
// [Note: block-sparse CUDA kernels]
// The CPU kernels' work items ([Note: block-sparse kernels]) as thread blocks: sdd computes one
// output block per thread block, dsd one (block row, 64 columns) of its output, dds one
// (64 rows, block column). Each walks its operands through shared memory in K steps of 32
// (zeros past the end) and multiplies there: on tensor cores (WMMA 16x16x16 with fp32
// accumulators) for fp16/bf16 on sm_80 and later, with fp32 FMAs otherwise. Work items write
// disjoint outputs, so no atomics. The softmax is one warp per query row over the row's
// non-zero blocks: a pass for the running max and sum (online softmax), a pass to write.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda_convert.cuh"
#include "sparse_attention_cuda.h"

namespace ds {
namespace {

using cvt::from_float;
using cvt::to_float;

constexpr int kK = 32;          // K step
constexpr int kPad = 8;         // shared rows padded by 16 bytes (16-bit) against bank conflicts;
                                // keeps every 16-row WMMA tile 32-byte aligned
constexpr int kRowsPerCta = 8;  // softmax: warps (query rows) per thread block
constexpr int kTile = 64;       // dsd's columns / dds's rows per thread block

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool kHaveTensorCores = true;
#else
constexpr bool kHaveTensorCores = false;
#endif

template <typename T>
constexpr bool kIs16 = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

// An MT x NT output tile: (MT/16)(NT/16) 16x16 sub-tiles over at most 8 warps.
template <int MT, int NT>
struct Shape {
  static constexpr int kSub = (MT / 16) * (NT / 16);
  static constexpr int kWarps = kSub < 8 ? kSub : 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kPer = MT * NT / kThreads;  // outputs per thread (FMA path)
  static constexpr int kFrags = kSub / kWarps;     // sub-tiles per warp (tensor cores)
};

// tile[r][c] = p[r * sr + c * sc] for r < rows, c < cols; zero elsewhere. The loop runs along
// whichever of the two is contiguous in memory, so a warp's loads coalesce.
template <typename T, int R, int C, int kThreads>
__device__ __forceinline__ void load_tile(T (*tile)[C + kPad], const T* p, int64_t sr, int64_t sc,
                                          int rows, int cols) {
  const T zero = from_float<T>(0.f);
  if (sr == 1 && sc != 1) {
    for (int e = threadIdx.x; e < R * C; e += kThreads) {
      const int r = e % R, c = e / R;
      tile[r][c] = (r < rows && c < cols) ? p[r * sr + c * sc] : zero;
    }
  } else {
    for (int e = threadIdx.x; e < R * C; e += kThreads) {
      const int r = e / C, c = e % C;
      tile[r][c] = (r < rows && c < cols) ? p[r * sr + c * sc] : zero;
    }
  }
}

// acc += a[MT][kK] @ b[kK][NT] from shared memory; store(f) calls f(i, j, value) once per
// output. Fp32 FMAs: each thread owns kPer outputs.
template <typename T, int MT, int NT, bool kTC = kIs16<T> && kHaveTensorCores>
struct TileMma {
  using Sh = Shape<MT, NT>;
  float v[Sh::kPer];

  __device__ void zero() {
#pragma unroll
    for (int q = 0; q < Sh::kPer; ++q) v[q] = 0.f;
  }
  __device__ void step(const T (*a)[kK + kPad], const T (*b)[NT + kPad]) {
#pragma unroll
    for (int q = 0; q < Sh::kPer; ++q) {
      const int e = threadIdx.x + q * Sh::kThreads, i = e / NT, j = e % NT;
      float s = v[q];
#pragma unroll 8
      for (int k = 0; k < kK; ++k) s += to_float(a[i][k]) * to_float(b[k][j]);
      v[q] = s;
    }
  }
  template <class F>
  __device__ void store(F&& f, float* /*stage*/) {
#pragma unroll
    for (int q = 0; q < Sh::kPer; ++q) {
      const int e = threadIdx.x + q * Sh::kThreads;
      f(e / NT, e % NT, v[q]);
    }
  }
};

// Tensor cores: each warp owns kFrags 16x16 accumulators; results leave through a per-warp
// 16x16 fp32 staging tile, as a fragment's element order is unspecified.
template <typename T, int MT, int NT>
struct TileMma<T, MT, NT, true> {
  using Sh = Shape<MT, NT>;
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> f[Sh::kFrags];

  __device__ static int sub(int q) { return static_cast<int>(threadIdx.x / 32) + q * Sh::kWarps; }
  __device__ void zero() {
#pragma unroll
    for (int q = 0; q < Sh::kFrags; ++q) nvcuda::wmma::fill_fragment(f[q], 0.f);
  }
  __device__ void step(const T (*a)[kK + kPad], const T (*b)[NT + kPad]) {
    using namespace nvcuda;
#pragma unroll
    for (int kk = 0; kk < kK; kk += 16) {
#pragma unroll
      for (int q = 0; q < Sh::kFrags; ++q) {
        const int s = sub(q), mi = s / (NT / 16), nj = s % (NT / 16);
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, &a[mi * 16][kk], kK + kPad);
        wmma::load_matrix_sync(fb, &b[kk][nj * 16], NT + kPad);
        wmma::mma_sync(f[q], fa, fb, f[q]);
      }
    }
  }
  template <class F>
  __device__ void store(F&& out, float* stage) {
    const int lane = threadIdx.x % 32;
    float* st = stage + (threadIdx.x / 32) * 256;
#pragma unroll
    for (int q = 0; q < Sh::kFrags; ++q) {
      const int s = sub(q), mi = s / (NT / 16), nj = s % (NT / 16);
      nvcuda::wmma::store_matrix_sync(st, f[q], 16, nvcuda::wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) out(mi * 16 + e / 16, nj * 16 + e % 16, st[e]);
      __syncwarp();
    }
  }
};

template <typename T, int MT, int NT>
struct Smem {
  alignas(32) T a[MT][kK + kPad];
  alignas(32) T b[kK][NT + kPad];
  alignas(32) float stage[kIs16<T> ? Shape<MT, NT>::kWarps * 256 : 1];
};

template <typename T>
__device__ __forceinline__ const T* at(const DenseView& v, int64_t b, int64_t h) {
  return static_cast<const T*>(v.p) + b * v.sb + h * v.sh;
}

template <typename T, int BS>
__global__ void __launch_bounds__(Shape<BS, BS>::kThreads)
    sdd_kernel(BlockLut L, DenseView A, DenseView B, int64_t K, T* out) {
  using Sh = Shape<BS, BS>;
  __shared__ __align__(32) Smem<T, BS, BS> sm;
  const int64_t w = blockIdx.x, b = w / L.nnz, z = w % L.nnz;
  const int64_t h = L.blocks[3 * z], r = L.blocks[3 * z + 1], c = L.blocks[3 * z + 2];
  const T* pa = at<T>(A, b, h) + r * BS * A.si;  // A's rows of block row r
  const T* pb = at<T>(B, b, h) + c * BS * B.sk;  // B's columns of block column c
  TileMma<T, BS, BS> acc;
  acc.zero();
  for (int64_t k0 = 0; k0 < K; k0 += kK) {
    const int ks = static_cast<int>(K - k0 < kK ? K - k0 : kK);
    load_tile<T, BS, kK, Sh::kThreads>(sm.a, pa + k0 * A.sk, A.si, A.sk, BS, ks);
    load_tile<T, kK, BS, Sh::kThreads>(sm.b, pb + k0 * B.si, B.si, B.sk, ks, BS);
    __syncthreads();
    acc.step(sm.a, sm.b);
    __syncthreads();
  }
  T* o = out + w * BS * BS;
  acc.store([&](int i, int j, float v) { o[i * BS + j] = from_float<T>(v); }, sm.stage);
}

template <typename T, int BS>
__global__ void __launch_bounds__(Shape<BS, kTile>::kThreads)
    dsd_kernel(BlockLut L, const T* S, bool trans_s, DenseView B, int64_t N, T* out) {
  using Sh = Shape<BS, kTile>;
  __shared__ __align__(32) Smem<T, BS, kTile> sm;
  const int64_t w = blockIdx.x, b = w / (L.heads * L.nb);
  const int64_t h = (w / L.nb) % L.heads, r = w % L.nb;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int nv = static_cast<int>(N - n0 < kTile ? N - n0 : kTile);
  // S's row r is stored row r (blocks by row), or, transposed, stored column r
  const int32_t* ptr = trans_s ? L.col_ptr : L.row_ptr;
  const int32_t* idx = trans_s ? L.col_idx : L.row_idx;
  const int64_t key = h * L.nb + r;
  const int64_t s_si = trans_s ? 1 : BS, s_sk = trans_s ? BS : 1;
  TileMma<T, BS, kTile> acc;
  acc.zero();
  for (int32_t e = ptr[key]; e < ptr[key + 1]; ++e) {
    const int64_t z = idx[e];
    const int64_t other = trans_s ? L.blocks[3 * z + 1] : L.blocks[3 * z + 2];
    const T* blk = S + (b * L.nnz + z) * BS * BS;
    const T* pb = at<T>(B, b, h) + other * BS * B.si + n0 * B.sk;
    for (int k0 = 0; k0 < BS; k0 += kK) {
      const int ks = BS - k0 < kK ? BS - k0 : kK;
      load_tile<T, BS, kK, Sh::kThreads>(sm.a, blk + k0 * s_sk, s_si, s_sk, BS, ks);
      load_tile<T, kK, kTile, Sh::kThreads>(sm.b, pb + k0 * B.si, B.si, B.sk, ks, nv);
      __syncthreads();
      acc.step(sm.a, sm.b);
      __syncthreads();
    }
  }
  T* o = out + ((b * L.heads + h) * L.nb * BS + r * BS) * N + n0;
  acc.store(
      [&](int i, int j, float v) {
        if (j < nv) o[i * N + j] = from_float<T>(v);
      },
      sm.stage);
}

template <typename T, int BS>
__global__ void __launch_bounds__(Shape<kTile, BS>::kThreads)
    dds_kernel(BlockLut L, DenseView A, int64_t M, const T* S, bool trans_s, T* out) {
  using Sh = Shape<kTile, BS>;
  __shared__ __align__(32) Smem<T, kTile, BS> sm;
  const int64_t w = blockIdx.x, b = w / (L.heads * L.nb);
  const int64_t h = (w / L.nb) % L.heads, c = w % L.nb;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int mv = static_cast<int>(M - m0 < kTile ? M - m0 : kTile);
  // S's column c is stored column c, or, transposed, stored row c
  const int32_t* ptr = trans_s ? L.row_ptr : L.col_ptr;
  const int32_t* idx = trans_s ? L.row_idx : L.col_idx;
  const int64_t key = h * L.nb + c;
  const int64_t s_sk = trans_s ? 1 : BS, s_sj = trans_s ? BS : 1;  // S logical (k, j)
  TileMma<T, kTile, BS> acc;
  acc.zero();
  for (int32_t e = ptr[key]; e < ptr[key + 1]; ++e) {
    const int64_t z = idx[e];
    const int64_t other = trans_s ? L.blocks[3 * z + 2] : L.blocks[3 * z + 1];
    const T* blk = S + (b * L.nnz + z) * BS * BS;
    const T* pa = at<T>(A, b, h) + m0 * A.si + other * BS * A.sk;
    for (int k0 = 0; k0 < BS; k0 += kK) {
      const int ks = BS - k0 < kK ? BS - k0 : kK;
      load_tile<T, kTile, kK, Sh::kThreads>(sm.a, pa + k0 * A.sk, A.si, A.sk, mv, ks);
      load_tile<T, kK, BS, Sh::kThreads>(sm.b, blk + k0 * s_sk, s_sk, s_sj, ks, BS);
      __syncthreads();
      acc.step(sm.a, sm.b);
      __syncthreads();
    }
  }
  const int64_t width = L.nb * BS;
  T* o = out + ((b * L.heads + h) * M + m0) * width + c * BS;
  acc.store(
      [&](int i, int j, float v) {
        if (i < mv) o[i * width + j] = from_float<T>(v);
      },
      sm.stage);
}

// The query row of a softmax warp: (batch, head, block row, row in block), its blocks e0..e1.
struct Row {
  int64_t b, h, r, i, e0, e1;
  __device__ Row(const BlockLut& L, int64_t row) {
    i = row % L.block;
    const int64_t key_b = row / L.block, keys = L.heads * L.nb, key = key_b % keys;
    b = key_b / keys;
    h = key / L.nb;
    r = key % L.nb;
    e0 = L.row_ptr[key];
    e1 = L.row_ptr[key + 1];
  }
};

constexpr float kNegInf = -INFINITY;

template <typename T>
__device__ __forceinline__ float score(const BlockLut& L, const Row& w, const T* x, float scale,
                                       const SoftmaxTerms& t, int64_t e, int64_t j, int64_t* off) {
  const int64_t bs = L.block, z = L.row_idx[e];
  const int64_t qi = w.r * bs + w.i, kj = L.blocks[3 * z + 2] * bs + j;
  *off = ((w.b * L.nnz + z) * bs + w.i) * bs + j;
  float s = to_float(x[*off]) * scale;
  if (t.rpe != nullptr) s += t.rpe[w.b * t.rpe_sb + w.h * t.rpe_sh + qi * t.rpe_si + kj];
  if (t.kp != nullptr) s += t.kp[w.b * t.kp_sb + kj];
  if (t.attn != nullptr) s += t.attn[qi * t.attn_si + kj];
  return s;
}

template <typename T>
__global__ void __launch_bounds__(32 * kRowsPerCta)
    softmax_fwd_kernel(BlockLut L, const T* x, T* y, float scale, SoftmaxTerms t, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const Row w(L, row);
  const int64_t n = (w.e1 - w.e0) * L.block;
  float m = kNegInf, sum = 0.f;
  int64_t off;
  for (int64_t k = lane; k < n; k += 32) {
    const float s = score(L, w, x, scale, t, w.e0 + k / L.block, k % L.block, &off);
    if (s > m) {
      sum = (m == kNegInf ? 0.f : sum * expf(m - s)) + 1.f;
      m = s;
    } else if (s != kNegInf) {
      sum += expf(s - m);
    }
  }
  for (int d = 16; d > 0; d >>= 1) {  // combine the lanes' (max, sum) pairs
    const float m2 = __shfl_xor_sync(0xffffffffu, m, d);
    const float s2 = __shfl_xor_sync(0xffffffffu, sum, d);
    const float mx = fmaxf(m, m2);
    sum = (m == kNegInf ? 0.f : sum * expf(m - mx)) + (m2 == kNegInf ? 0.f : s2 * expf(m2 - mx));
    m = mx;
  }
  const float inv = m == kNegInf ? 0.f : 1.f / sum;  // a row all -inf gives zeros
  for (int64_t k = lane; k < n; k += 32) {
    const float s = score(L, w, x, scale, t, w.e0 + k / L.block, k % L.block, &off);
    y[off] = from_float<T>(s == kNegInf ? 0.f : expf(s - m) * inv);
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kRowsPerCta)
    softmax_bwd_kernel(BlockLut L, const T* y, const T* dy, T* dx, float scale, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const Row w(L, row);
  const int64_t bs = L.block, n = (w.e1 - w.e0) * bs;
  auto offset = [&](int64_t k) {
    return ((w.b * L.nnz + L.row_idx[w.e0 + k / bs]) * bs + w.i) * bs + k % bs;
  };
  float dot = 0.f;
  for (int64_t k = lane; k < n; k += 32) dot += to_float(y[offset(k)]) * to_float(dy[offset(k)]);
  for (int d = 16; d > 0; d >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, d);
  for (int64_t k = lane; k < n; k += 32) {
    const int64_t o = offset(k);
    dx[o] = from_float<T>(scale * to_float(y[o]) * (to_float(dy[o]) - dot));
  }
}

template <typename F>
void dispatch(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
  }
}

// Calls f(std::integral_constant<int, BS>) for the layout's block size.
template <typename F>
void dispatch_block(int64_t block, F&& f) {
  switch (block) {
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    default: break;
  }
}

unsigned blocks_for(int64_t rows) {
  return static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta);
}

unsigned tiles(int64_t n) { return static_cast<unsigned>((n + kTile - 1) / kTile); }

}  // namespace

bool bsr_cuda_block_ok(int64_t block) {
  return block == 16 || block == 32 || block == 64 || block == 128;
}

cudaError_t bsr_sdd_cuda(DType t, const BlockLut& lut, const DenseView& a, const DenseView& b,
                         int64_t k, void* out, int64_t batch, cudaStream_t stream) {
  if (batch * lut.nnz == 0) return cudaSuccess;
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    dispatch_block(lut.block, [&](auto bs) {
      constexpr int BS = decltype(bs)::value;
      sdd_kernel<T, BS>
          <<<static_cast<unsigned>(batch * lut.nnz), Shape<BS, BS>::kThreads, 0, stream>>>(
              lut, a, b, k, static_cast<T*>(out));
    });
  });
  return cudaGetLastError();
}

cudaError_t bsr_dsd_cuda(DType t, const BlockLut& lut, const void* s, bool trans_s,
                         const DenseView& b, int64_t n, void* out, int64_t batch,
                         cudaStream_t stream) {
  if (batch * n == 0) return cudaSuccess;
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    dispatch_block(lut.block, [&](auto bs) {
      constexpr int BS = decltype(bs)::value;
      const dim3 grid(static_cast<unsigned>(batch * lut.heads * lut.nb), tiles(n));
      dsd_kernel<T, BS><<<grid, Shape<BS, kTile>::kThreads, 0, stream>>>(
          lut, static_cast<const T*>(s), trans_s, b, n, static_cast<T*>(out));
    });
  });
  return cudaGetLastError();
}

cudaError_t bsr_dds_cuda(DType t, const BlockLut& lut, const DenseView& a, int64_t m, const void* s,
                         bool trans_s, void* out, int64_t batch, cudaStream_t stream) {
  if (batch * m == 0) return cudaSuccess;
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    dispatch_block(lut.block, [&](auto bs) {
      constexpr int BS = decltype(bs)::value;
      const dim3 grid(static_cast<unsigned>(batch * lut.heads * lut.nb), tiles(m));
      dds_kernel<T, BS><<<grid, Shape<kTile, BS>::kThreads, 0, stream>>>(
          lut, a, m, static_cast<const T*>(s), trans_s, static_cast<T*>(out));
    });
  });
  return cudaGetLastError();
}

cudaError_t bsr_softmax_fwd_cuda(DType t, const BlockLut& lut, const void* x, void* y, float scale,
                                 const SoftmaxTerms& terms, int64_t batch, cudaStream_t stream) {
  const int64_t rows = batch * lut.heads * lut.nb * lut.block;
  if (rows == 0) return cudaSuccess;
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    softmax_fwd_kernel<T><<<blocks_for(rows), 32 * kRowsPerCta, 0, stream>>>(
        lut, static_cast<const T*>(x), static_cast<T*>(y), scale, terms, rows);
  });
  return cudaGetLastError();
}

cudaError_t bsr_softmax_bwd_cuda(DType t, const BlockLut& lut, const void* y, const void* dy,
                                 void* dx, float scale, int64_t batch, cudaStream_t stream) {
  const int64_t rows = batch * lut.heads * lut.nb * lut.block;
  if (rows == 0) return cudaSuccess;
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    softmax_bwd_kernel<T><<<blocks_for(rows), 32 * kRowsPerCta, 0, stream>>>(
        lut, static_cast<const T*>(y), static_cast<const T*>(dy), static_cast<T*>(dx), scale, rows);
  });
  return cudaGetLastError();
}

}  // namespace ds
