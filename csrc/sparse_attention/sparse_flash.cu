// Fused block-sparse attention on CUDA ([Note: fused block-sparse attention]).
//
// [Note: fused block-sparse attention]
// SparseSelfAttention without rpe or masks as three kernels that never write the scores (the
// unfused ops write the scores, the probabilities and their gradients, each batch * nnz *
// block^2): the forward; dK and dV by key tile; dQ by query tile, so nothing needs atomics.
// - Tiles are 64 queries by 64 keys. A layout block of 64 is one tile, one of 128 four. The
//   forward and dQ walk a query tile's layout row (row_ptr), dK/dV a key tile's column
//   (col_ptr).
// - A thread block is 4 warps, and each warp owns 16 rows of every tile it computes: queries in
//   the forward and dQ, keys in dK/dV. The products run on tensor cores (WMMA 16x16x16, fp32
//   accumulators) from shared memory. Each warp rescales and exponentiates its own rows of the
//   scores there, so only the loads of shared operands need a block barrier.
// - Scores are kept in log2 units (scale * log2(e) folded in). The forward keeps a running max
//   and sum per query (online softmax), rescales its fp32 output rows by exp2(old - new max),
//   and saves each query's log2-sum-exp; the backward recomputes P = exp2(S - lse) from it.
// - dS = P (dP - rowsum(dO * O)) is rounded to 16 bits before its products, as P is before PV
//   (as in FlashAttention).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda_convert.cuh"
#include "sparse_flash_cuda.h"

namespace ds {
namespace {

using cvt::from_float;
using cvt::to_float;
namespace wm = nvcuda::wmma;

constexpr int kT = 64;  // tile side: queries and keys
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;

using Acc = wm::fragment<wm::accumulator, 16, 16, 16, float>;

// Shared memory: 16-bit rows padded by 16 bytes and fp32 rows by 16 bytes (against bank
// conflicts); every size is a multiple of 32 bytes, so each 16-row WMMA tile stays aligned.
template <typename T, int D>
struct Ld {
  static constexpr int kTile = D + 8;  // a 64 x D tile of T
  static constexpr int kS = kT + 4;    // a 64 x 64 fp32 tile
  static constexpr int kP = kT + 8;    // a 64 x 64 tile of T
  static constexpr int kO = D + 4;     // a 64 x D fp32 tile
  static constexpr size_t kTileBytes = sizeof(T) * kT * kTile;
  static constexpr size_t kSBytes = sizeof(float) * kT * kS;
  static constexpr size_t kPBytes = sizeof(T) * kT * kP;
  static constexpr size_t kOBytes = sizeof(float) * kT * kO;
  static constexpr size_t kRowBytes = sizeof(float) * kT;
  static constexpr size_t kFwd = 3 * kTileBytes + kSBytes + kPBytes + kOBytes + 2 * kRowBytes;
  static constexpr size_t kBwdKV = 4 * kTileBytes + 2 * kSBytes + 2 * kPBytes + 2 * kRowBytes;
  static constexpr size_t kBwdQ = 4 * kTileBytes + 2 * kSBytes + kPBytes + 2 * kRowBytes;
};

// A bump allocator over the dynamic shared memory.
struct Carve {
  unsigned char* p;
  template <typename U>
  __device__ U* take(size_t bytes) {
    U* r = reinterpret_cast<U*>(p);
    p += bytes;
    return r;
  }
};

// dst[64][D + 8] = the 64 contiguous rows of D elements at src, in 16-byte pieces.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T* dst, const T* src) {
  constexpr int kVec = 16 / sizeof(T), kPerRow = D / kVec;
  for (int e = threadIdx.x; e < kT * kPerRow; e += kThreads) {
    const int r = e / kPerRow, c = (e % kPerRow) * kVec;
    *reinterpret_cast<uint4*>(dst + r * Ld<T, D>::kTile + c) =
        __ldg(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r) * D + c));
  }
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

// acc[n] = a[16][K] @ b^T for 16-column slices n, where bt holds b's transpose: N rows of K.
template <typename T, int K, int N>
__device__ __forceinline__ void mma_abt(Acc (&acc)[N / 16], const T* a, int lda, const T* bt,
                                        int ldb) {
#pragma unroll
  for (int n = 0; n < N / 16; ++n) wm::fill_fragment(acc[n], 0.f);
#pragma unroll
  for (int k = 0; k < K; k += 16) {
    wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fa;
    wm::load_matrix_sync(fa, a + k, lda);
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
      wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major> fb;
      wm::load_matrix_sync(fb, bt + n * 16 * ldb + k, ldb);
      wm::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// acc[n] += a[16][K] @ b[K][N] (b row-major), for 16-column slices n.
template <typename T, int K, int N>
__device__ __forceinline__ void mma_ab(Acc (&acc)[N / 16], const T* a, int lda, const T* b,
                                       int ldb) {
#pragma unroll
  for (int k = 0; k < K; k += 16) {
    wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fa;
    wm::load_matrix_sync(fa, a + k, lda);
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
      wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major> fb;
      wm::load_matrix_sync(fb, b + k * ldb + n * 16, ldb);
      wm::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

template <int N>
__device__ __forceinline__ void store_rows(float* dst, int ld, Acc (&acc)[N / 16]) {
#pragma unroll
  for (int n = 0; n < N / 16; ++n)
    wm::store_matrix_sync(dst + n * 16, acc[n], ld, wm::mem_row_major);
}

// The warp's 16 rows of a [64, D] fp32 result to global rows out[row * D + col] * mul, through a
// 16x16 staging tile of the warp's own (`stage`, 256 floats).
template <typename T, int D>
__device__ __forceinline__ void write_rows(T* out, Acc (&acc)[D / 16], float mul, float* stage) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wm::store_matrix_sync(stage, acc[n], 16, wm::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {
      out[static_cast<int64_t>(e / 16) * D + n * 16 + e % 16] = from_float<T>(stage[e] * mul);
    }
    __syncwarp();
  }
}

// Which tiles a layout block holds: tile t of a side lies in layout block t / sub.
struct Tiling {
  int64_t bh, h, seq;
  int sub;
  __device__ explicit Tiling(const BlockLut& L) {
    bh = blockIdx.y;
    h = bh % L.heads;
    seq = L.nb * L.block;
    sub = static_cast<int>(L.block / kT);
  }
};

// One tile of the forward's online softmax over the warp's 16 rows: two lanes per row, 32
// columns each, so a row's max and sum take one shuffle. Each lane starts its columns at its own
// offset (5 row + 16 half, mod 32 banks), so the 32 lanes' reads hit 32 different banks. Writes
// the row's probabilities (P, 16-bit) and rescales its output row by exp2(old max - new max),
// which is skipped when the max did not move.
template <typename T, int D>
__device__ __forceinline__ void online_softmax(const float* ss, T* ps, float* os, float* ms,
                                               float* ls, int r0, float sl2) {
  using S = Ld<T, D>;
  const int lane = threadIdx.x % 32, half = lane & 1, r = r0 + (lane >> 1);
  const int rot = ((lane >> 1) + 16 * half) & 31;
  const float* srow = ss + r * S::kS + half * 32;
  T* prow = ps + r * S::kP + half * 32;
  float mx = -INFINITY;
#pragma unroll 8
  for (int i = 0; i < 32; ++i) mx = fmaxf(mx, srow[(i + rot) & 31] * sl2);
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  const float m_old = ms[r], m_new = fmaxf(m_old, mx);
  float sum = 0.f;
#pragma unroll 8
  for (int i = 0; i < 32; ++i) {
    const int c = (i + rot) & 31;
    const float p = exp2f(srow[c] * sl2 - m_new);
    sum += p;
    prow[c] = from_float<T>(p);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  const float alpha = m_old == -INFINITY ? 0.f : exp2f(m_old - m_new);
  if (alpha != 1.f) {
    float* orow = os + r * S::kO + half * (D / 2);
#pragma unroll 8
    for (int j = 0; j < D / 2; ++j) orow[(j + rot) % (D / 2)] *= alpha;
  }
  __syncwarp();  // both lanes of the row have read ms[r]
  if (half == 0) {
    ms[r] = m_new;
    ls[r] = ls[r] * alpha + sum;
  }
  __syncwarp();
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_fwd_kernel(BlockLut L, const T* q, const T* k, const T* v, T* o, float* lse,
                     float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 WMMA needs sm_80; the binding refuses older devices
#else
  using S = Ld<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carve cv{smem};
  T* qs = cv.take<T>(S::kTileBytes);
  T* ks = cv.take<T>(S::kTileBytes);
  T* vs = cv.take<T>(S::kTileBytes);
  float* ss = cv.take<float>(S::kSBytes);
  T* ps = cv.take<T>(S::kPBytes);
  float* os = cv.take<float>(S::kOBytes);
  float* ms = cv.take<float>(S::kRowBytes);
  float* ls = cv.take<float>(S::kRowBytes);
  const Tiling g(L);
  const int64_t t = blockIdx.x, key = g.h * L.nb + t / g.sub, base = g.bh * g.seq * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const float sl2 = scale * kLog2e;
  load_tile<T, D>(qs, q + base + t * kT * D);
  for (int e = lane; e < 16 * S::kO; e += 32) os[r0 * S::kO + e] = 0.f;
  if (lane < 16) {
    ms[r0 + lane] = -INFINITY;
    ls[r0 + lane] = 0.f;
  }
  for (int32_t e = L.row_ptr[key]; e < L.row_ptr[key + 1]; ++e) {
    const int64_t c = L.blocks[3 * static_cast<int64_t>(L.row_idx[e]) + 2];
    for (int j = 0; j < g.sub; ++j) {
      const int64_t kt = c * g.sub + j;
      __syncthreads();  // every warp is done with the previous K and V (and Q is in)
      load_tile<T, D>(ks, k + base + kt * kT * D);
      load_tile<T, D>(vs, v + base + kt * kT * D);
      __syncthreads();
      Acc s[kT / 16];
      mma_abt<T, D, kT>(s, qs + r0 * S::kTile, S::kTile, ks, S::kTile);
      store_rows<kT>(ss + r0 * S::kS, S::kS, s);
      __syncwarp();
      online_softmax<T, D>(ss, ps, os, ms, ls, r0, sl2);
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {  // O += P V, one 16-column slice at a time
        Acc acc;
        float* dst = os + r0 * S::kO + n * 16;
        wm::load_matrix_sync(acc, dst, S::kO, wm::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < kT; kk += 16) {
          wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fa;
          wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major> fb;
          wm::load_matrix_sync(fa, ps + r0 * S::kP + kk, S::kP);
          wm::load_matrix_sync(fb, vs + kk * S::kTile + n * 16, S::kTile);
          wm::mma_sync(acc, fa, fb, acc);
        }
        wm::store_matrix_sync(dst, acc, S::kO, wm::mem_row_major);
      }
      __syncwarp();
    }
  }
  for (int i = 0; i < 16; ++i) {
    const int r = r0 + i;
    const float l = ls[r], inv = l > 0.f ? 1.f / l : 0.f;  // a row with no keys gives zeros
    T* orow = o + base + (t * kT + r) * D;
    for (int d = lane; d < D; d += 32) orow[d] = from_float<T>(os[r * S::kO + d] * inv);
    if (lane == 0) lse[g.bh * g.seq + t * kT + r] = l > 0.f ? ms[r] + log2f(l) : INFINITY;
  }
#endif
}

// dvec[row] = sum over d of dout * o: the softmax backward's per-query dot product.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_dot_kernel(const T* o, const T* dout, float* dvec, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float s = 0.f;
  for (int d = lane; d < D; d += 32) s += to_float(o[row * D + d]) * to_float(dout[row * D + d]);
  s = warp_sum(s);
  if (lane == 0) dvec[row] = s;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_bwd_kv_kernel(BlockLut L, const T* q, const T* k, const T* v, const T* dout,
                        const float* lse, const float* dvec, T* dk, T* dv, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using S = Ld<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carve cv{smem};
  T* ks = cv.take<T>(S::kTileBytes);
  T* vs = cv.take<T>(S::kTileBytes);
  T* qs = cv.take<T>(S::kTileBytes);
  T* dos = cv.take<T>(S::kTileBytes);
  float* st = cv.take<float>(S::kSBytes);   // S^T: keys x queries
  float* dpt = cv.take<float>(S::kSBytes);  // dP^T
  T* pt = cv.take<T>(S::kPBytes);
  T* dst = cv.take<T>(S::kPBytes);
  float* lq = cv.take<float>(S::kRowBytes);
  float* dq_dot = cv.take<float>(S::kRowBytes);
  const Tiling g(L);
  const int64_t t = blockIdx.x, key = g.h * L.nb + t / g.sub, base = g.bh * g.seq * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const float sl2 = scale * kLog2e;
  load_tile<T, D>(ks, k + base + t * kT * D);
  load_tile<T, D>(vs, v + base + t * kT * D);
  Acc dkf[D / 16], dvf[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wm::fill_fragment(dkf[n], 0.f);
    wm::fill_fragment(dvf[n], 0.f);
  }
  for (int32_t e = L.col_ptr[key]; e < L.col_ptr[key + 1]; ++e) {
    const int64_t r = L.blocks[3 * static_cast<int64_t>(L.col_idx[e]) + 1];
    for (int i = 0; i < g.sub; ++i) {
      const int64_t qt = r * g.sub + i, row0 = g.bh * g.seq + qt * kT;
      __syncthreads();  // every warp is done with the previous Q, dO and row terms
      load_tile<T, D>(qs, q + base + qt * kT * D);
      load_tile<T, D>(dos, dout + base + qt * kT * D);
      if (threadIdx.x < kT) {
        lq[threadIdx.x] = lse[row0 + threadIdx.x];
        dq_dot[threadIdx.x] = dvec[row0 + threadIdx.x];
      }
      __syncthreads();
      Acc a[kT / 16];
      mma_abt<T, D, kT>(a, ks + r0 * S::kTile, S::kTile, qs, S::kTile);  // S^T = K Q^T
      store_rows<kT>(st + r0 * S::kS, S::kS, a);
      mma_abt<T, D, kT>(a, vs + r0 * S::kTile, S::kTile, dos, S::kTile);  // dP^T = V dO^T
      store_rows<kT>(dpt + r0 * S::kS, S::kS, a);
      __syncwarp();
      for (int ii = 0; ii < 16; ++ii) {
        const int rr = r0 + ii;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int col = lane + 32 * half;  // the query
          const float p = exp2f(st[rr * S::kS + col] * sl2 - lq[col]);
          pt[rr * S::kP + col] = from_float<T>(p);
          dst[rr * S::kP + col] = from_float<T>(p * (dpt[rr * S::kS + col] - dq_dot[col]));
        }
      }
      __syncwarp();
      mma_ab<T, kT, D>(dvf, pt + r0 * S::kP, S::kP, dos, S::kTile);  // dV += P^T dO
      mma_ab<T, kT, D>(dkf, dst + r0 * S::kP, S::kP, qs, S::kTile);  // dK += dS^T Q
    }
  }
  const int64_t out0 = base + (t * kT + r0) * D;
  write_rows<T, D>(dk + out0, dkf, scale, st + r0 * S::kS);
  write_rows<T, D>(dv + out0, dvf, 1.f, st + r0 * S::kS);
#endif
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_bwd_q_kernel(BlockLut L, const T* q, const T* k, const T* v, const T* dout,
                       const float* lse, const float* dvec, T* dq, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using S = Ld<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carve cv{smem};
  T* qs = cv.take<T>(S::kTileBytes);
  T* dos = cv.take<T>(S::kTileBytes);
  T* ks = cv.take<T>(S::kTileBytes);
  T* vs = cv.take<T>(S::kTileBytes);
  float* ss = cv.take<float>(S::kSBytes);
  float* dps = cv.take<float>(S::kSBytes);
  T* dss = cv.take<T>(S::kPBytes);
  float* lq = cv.take<float>(S::kRowBytes);
  float* dq_dot = cv.take<float>(S::kRowBytes);
  const Tiling g(L);
  const int64_t t = blockIdx.x, key = g.h * L.nb + t / g.sub, base = g.bh * g.seq * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const float sl2 = scale * kLog2e;
  load_tile<T, D>(qs, q + base + t * kT * D);
  load_tile<T, D>(dos, dout + base + t * kT * D);
  if (threadIdx.x < kT) {
    lq[threadIdx.x] = lse[g.bh * g.seq + t * kT + threadIdx.x];
    dq_dot[threadIdx.x] = dvec[g.bh * g.seq + t * kT + threadIdx.x];
  }
  Acc dqf[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wm::fill_fragment(dqf[n], 0.f);
  for (int32_t e = L.row_ptr[key]; e < L.row_ptr[key + 1]; ++e) {
    const int64_t c = L.blocks[3 * static_cast<int64_t>(L.row_idx[e]) + 2];
    for (int j = 0; j < g.sub; ++j) {
      const int64_t kt = c * g.sub + j;
      __syncthreads();  // every warp is done with the previous K and V (and Q, dO are in)
      load_tile<T, D>(ks, k + base + kt * kT * D);
      load_tile<T, D>(vs, v + base + kt * kT * D);
      __syncthreads();
      Acc a[kT / 16];
      mma_abt<T, D, kT>(a, qs + r0 * S::kTile, S::kTile, ks, S::kTile);  // S = Q K^T
      store_rows<kT>(ss + r0 * S::kS, S::kS, a);
      mma_abt<T, D, kT>(a, dos + r0 * S::kTile, S::kTile, vs, S::kTile);  // dP = dO V^T
      store_rows<kT>(dps + r0 * S::kS, S::kS, a);
      __syncwarp();
      for (int ii = 0; ii < 16; ++ii) {
        const int rr = r0 + ii;
        const float lrow = lq[rr], drow = dq_dot[rr];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int col = lane + 32 * half;  // the key
          const float p = exp2f(ss[rr * S::kS + col] * sl2 - lrow);
          dss[rr * S::kP + col] = from_float<T>(p * (dps[rr * S::kS + col] - drow));
        }
      }
      __syncwarp();
      mma_ab<T, kT, D>(dqf, dss + r0 * S::kP, S::kP, ks, S::kTile);  // dQ += dS K
    }
  }
  write_rows<T, D>(dq + base + (t * kT + r0) * D, dqf, scale, ss + r0 * S::kS);
#endif
}

// Calls f(T{}, std::integral_constant<int, D>{}) for a 16-bit dtype and head size 64 or 128.
template <typename F>
void dispatch(DType t, int64_t head_dim, F&& f) {
  auto by_dim = [&](auto tag) {
    if (head_dim == 64) f(tag, std::integral_constant<int, 64>{});
    if (head_dim == 128) f(tag, std::integral_constant<int, 128>{});
  };
  if (t == DType::kFloat16) by_dim(__half{});
  if (t == DType::kBFloat16) by_dim(__nv_bfloat16{});
}

// Kernels over more than 48 KiB of shared memory must ask for it, once per kernel.
template <typename K>
cudaError_t allow_smem(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

dim3 grid_of(const BlockLut& L, int64_t batch) {
  return dim3(static_cast<unsigned>(L.nb * L.block / kT), static_cast<unsigned>(batch * L.heads));
}

}  // namespace

bool bsr_flash_ok(int64_t block, int64_t head_dim) {
  return (block == 64 || block == 128) && (head_dim == 64 || head_dim == 128);
}

cudaError_t bsr_flash_fwd_cuda(DType t, const BlockLut& lut, const void* q, const void* k,
                               const void* v, void* o, float* lse, int64_t batch, int64_t head_dim,
                               float scale, cudaStream_t stream) {
  if (batch * lut.nb == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;  // stays so for a dtype or size with no kernel
  dispatch(t, head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    constexpr size_t bytes = Ld<T, D>::kFwd;
    err = allow_smem(flash_fwd_kernel<T, D>, bytes);
    if (err != cudaSuccess) return;
    flash_fwd_kernel<T, D><<<grid_of(lut, batch), kThreads, bytes, stream>>>(
        lut, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<T*>(o), lse, scale);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t bsr_flash_bwd_cuda(DType t, const BlockLut& lut, const void* q, const void* k,
                               const void* v, const void* o, const float* lse, const void* dout,
                               float* dvec, void* dq, void* dk, void* dv, int64_t batch,
                               int64_t head_dim, float scale, cudaStream_t stream) {
  if (batch * lut.nb == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  dispatch(t, head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    const auto* qt = static_cast<const T*>(q);
    const auto* kt = static_cast<const T*>(k);
    const auto* vt = static_cast<const T*>(v);
    const auto* dot = static_cast<const T*>(dout);
    const int64_t rows = batch * lut.heads * lut.nb * lut.block;
    flash_dot_kernel<T, D>
        <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
            static_cast<const T*>(o), dot, dvec, rows);
    err = cudaGetLastError();
    if (err != cudaSuccess) return;
    err = allow_smem(flash_bwd_kv_kernel<T, D>, Ld<T, D>::kBwdKV);
    if (err != cudaSuccess) return;
    flash_bwd_kv_kernel<T, D><<<grid_of(lut, batch), kThreads, Ld<T, D>::kBwdKV, stream>>>(
        lut, qt, kt, vt, dot, lse, dvec, static_cast<T*>(dk), static_cast<T*>(dv), scale);
    err = cudaGetLastError();
    if (err != cudaSuccess) return;
    err = allow_smem(flash_bwd_q_kernel<T, D>, Ld<T, D>::kBwdQ);
    if (err != cudaSuccess) return;
    flash_bwd_q_kernel<T, D><<<grid_of(lut, batch), kThreads, Ld<T, D>::kBwdQ, stream>>>(
        lut, qt, kt, vt, dot, lse, dvec, static_cast<T*>(dq), scale);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace ds
