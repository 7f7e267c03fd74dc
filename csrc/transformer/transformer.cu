// CUDA kernels of the fused transformer layer ([Note: transformer kernels]): the CPU kernels'
// math (transformer_core.cpp) with one block per row for the row-wise steps (LayerNorm,
// softmax) and grid-stride loops for the element-wise ones. fp32 math on fp32/fp16/bf16
// storage; dropout masks from [Note: replayed dropout], so CPU and GPU draw the same masks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cuda_convert.cuh"
#include "dropout_rng.h"
#include "transformer_cuda.h"

namespace ds {
namespace {

using cvt::from_float;
using cvt::to_float;

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;
constexpr float kGeluK = 0.7978845608028654f;
constexpr float kGeluC = 0.044715f;

__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, off));
  return x;
}

// The block's sum (or max) of v, returned to every thread. Every thread must call it.
template <bool kMax>
__device__ float block_reduce(float v) {
  __shared__ float part[32];
  __shared__ float total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // an earlier call's readers of `total` are done
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) >> 5;
    const float init = kMax ? -INFINITY : 0.f;
    float w = lane < warps ? part[lane] : init;
    w = kMax ? warp_max(w) : warp_sum(w);
    if (lane == 0) total = w;
  }
  __syncthreads();
  return total;
}

template <typename T>
__global__ void ln_fwd(const T* x, const T* g, const T* b, T* y, float* mean, float* rstd,
                       int64_t rows, int64_t h, float eps) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * h;
    float s = 0.f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) s += to_float(xr[j]);
    const float m = block_reduce<false>(s) / h;
    float q = 0.f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float d = to_float(xr[j]) - m;
      q += d * d;
    }
    const float rs = rsqrtf(block_reduce<false>(q) / h + eps);
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      y[r * h + j] = from_float<T>((to_float(xr[j]) - m) * rs * to_float(g[j]) + to_float(b[j]));
    }
    if (threadIdx.x == 0) {
      mean[r] = m;
      rstd[r] = rs;
    }
  }
}

// Each block takes rows blockIdx.x, +gridDim.x, ...; thread t owns columns t, t+blockDim, ...
// of this block's dgamma/dbeta partial row, so the partials need no atomics.
template <typename T>
__global__ void ln_bwd(const T* dy, const T* src, bool from_y, const T* g, const T* b,
                       const float* mean, const float* rstd, T* dx, float* dg_part, float* db_part,
                       int64_t rows, int64_t h) {
  float* dgp = dg_part + blockIdx.x * h;
  float* dbp = db_part + blockIdx.x * h;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) dgp[j] = dbp[j] = 0.f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float rs = rstd[r], m = mean[r];
    float a = 0.f, c = 0.f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float gj = to_float(g[j]), s = to_float(src[r * h + j]);
      const float xhat = from_y ? (s - to_float(b[j])) / gj : (s - m) * rs;
      const float d = to_float(dy[r * h + j]);
      a += d * gj;
      c += d * gj * xhat;
      dgp[j] += d * xhat;
      dbp[j] += d;
    }
    a = block_reduce<false>(a) / h;
    c = block_reduce<false>(c) / h;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float gj = to_float(g[j]), s = to_float(src[r * h + j]);
      const float xhat = from_y ? (s - to_float(b[j])) / gj : (s - m) * rs;
      const float dxhat = to_float(dy[r * h + j]) * gj;
      dx[r * h + j] = from_float<T>(rs * (dxhat - a - xhat * c));
    }
  }
}

// tanh as 1 - 2 / (e^2z + 1), the CPU core's fast_tanh: under --use_fast_math, tanhf becomes
// tanh.approx (about 11 bits), and GeLU's backward (1 - t^2 near saturation) amplifies that
// error past fp32's tolerance; __expf keeps ~21 bits. Saturates cleanly: e^2z -> inf gives 1.
__device__ __forceinline__ float gelu_tanh(float u) {
  const float z = kGeluK * (u + kGeluC * u * u * u);
  return 1.f - 2.f / (__expf(2.f * z) + 1.f);
}

__device__ __forceinline__ float gelu(float u) { return 0.5f * u * (1.f + gelu_tanh(u)); }

__device__ __forceinline__ float gelu_grad(float u) {
  const float t = gelu_tanh(u);
  return 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * kGeluK * (1.f + 3.f * kGeluC * u * u);
}

// V consecutive elements moved as one aligned access (16 bytes when V = 16 / sizeof(T)).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load(const T* p, int64_t i) {
  return reinterpret_cast<const Pack<T, V>*>(p)[i];
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, int64_t i, const Pack<T, V>& v) {
  reinterpret_cast<Pack<T, V>*>(p)[i] = v;
}

// The row-wise element-wise kernels ([rows, n], a bias of n): block (tx, ty) takes rows
// blockIdx.x * ty + threadIdx.y, stepping gridDim.x * ty; its tx threads stride over the row's
// packs. Row and column come from the loop, not from a 64-bit division per element.
struct RowLoop {
  int64_t rows, packs;  // packs per row
};

#define DS_FOR_ROW_PACKS(L)                                                      \
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < (L).rows; \
       r += int64_t(gridDim.x) * blockDim.y)                                     \
    for (int64_t c = threadIdx.x; c < (L).packs; c += blockDim.x)

template <typename T, int V>
__global__ void gelu_fwd(const T* x, const T* bias, T* y, RowLoop L) {
  DS_FOR_ROW_PACKS(L) {
    const int64_t i = r * L.packs + c;
    const Pack<T, V> xv = load<T, V>(x, i), bv = load<T, V>(bias, c);
    Pack<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k)
      out.v[k] = from_float<T>(gelu(to_float(xv.v[k]) + to_float(bv.v[k])));
    store<T, V>(y, i, out);
  }
}

template <typename T, int V>
__global__ void gelu_bwd(const T* dy, const T* x, const T* bias, T* dx, RowLoop L) {
  DS_FOR_ROW_PACKS(L) {
    const int64_t i = r * L.packs + c;
    const Pack<T, V> dv = load<T, V>(dy, i), xv = load<T, V>(x, i), bv = load<T, V>(bias, c);
    Pack<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      out.v[k] =
          from_float<T>(to_float(dv.v[k]) * gelu_grad(to_float(xv.v[k]) + to_float(bv.v[k])));
    }
    store<T, V>(dx, i, out);
  }
}

template <typename T, int V>
__global__ void bias_drop_res(const T* x, const T* bias, const T* res, T* out, float p,
                              uint64_t seed, uint64_t offset, RowLoop L) {
  DropoutMask mask(seed, drop_threshold(p));
  const float scale = dropout_scale(p);
  DS_FOR_ROW_PACKS(L) {
    const int64_t i = r * L.packs + c;
    const Pack<T, V> xv = load<T, V>(x, i), bv = load<T, V>(bias, c), rv = load<T, V>(res, i);
    Pack<T, V> o;
    const uint64_t e = offset + uint64_t(i) * V;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float v = to_float(xv.v[k]) + to_float(bv.v[k]);
      o.v[k] = from_float<T>(to_float(rv.v[k]) + (mask.keep(e + k) ? v * scale : 0.f));
    }
    store<T, V>(out, i, o);
  }
}

template <typename T, int V>
__global__ void drop(const T* x, T* out, float p, uint64_t seed, uint64_t offset, int64_t packs) {
  DropoutMask mask(seed, drop_threshold(p));
  const float scale = dropout_scale(p);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Pack<T, V> xv = load<T, V>(x, i);
    Pack<T, V> o;
    const uint64_t e = offset + uint64_t(i) * V;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      o.v[k] = from_float<T>(mask.keep(e + k) ? to_float(xv.v[k]) * scale : 0.f);
    }
    store<T, V>(out, i, o);
  }
}

// Softmax rows of up to 32 * kPer keys, one warp per row, the row held in registers (lane l
// owns keys l, l + 32, ...): one read, one write, warp shuffles only. Attention rows are short
// (the sequence length), so a block per row would leave most of its threads idle.
constexpr int kRowsPerWarpBlock = 4;

__device__ __forceinline__ const float* mask_row(const float* mask, const SoftmaxShape& s,
                                                 int64_t r) {
  if (mask == nullptr) return nullptr;
  return mask + ((r / s.rows_per_batch) * s.mq + (s.mq > 1 ? r % s.sq : 0)) * s.sk;
}

template <typename T, int kPer>
__global__ void smax_fwd_warp(const T* scores, const float* mask, T* probs, float scale,
                              SoftmaxShape s, int64_t rows) {
  const int lane = threadIdx.x & 31;
  const int64_t n = s.sk;
  for (int64_t r = blockIdx.x * int64_t(kRowsPerWarpBlock) + (threadIdx.x >> 5); r < rows;
       r += int64_t(gridDim.x) * kRowsPerWarpBlock) {
    const T* row = scores + r * n;
    const float* m = mask_row(mask, s, r);
    float v[kPer];
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t j = lane + 32 * k;
      v[k] = j < n ? to_float(row[j]) * scale + (m != nullptr ? m[j] : 0.f) : -INFINITY;
      mx = fmaxf(mx, v[k]);
    }
    mx = __shfl_sync(0xffffffffu, warp_max(mx), 0);
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      v[k] = mx == -INFINITY ? 0.f : __expf(v[k] - mx);  // every key masked: attend to nothing
      sum += v[k];
    }
    sum = __shfl_sync(0xffffffffu, warp_sum(sum), 0);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t j = lane + 32 * k;
      if (j < n) probs[r * n + j] = from_float<T>(v[k] * inv);
    }
  }
}

template <typename T, int kPer>
__global__ void smax_bwd_warp(const T* dprobs, const T* probs, T* dscores, float scale, int64_t n,
                              int64_t rows) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = blockIdx.x * int64_t(kRowsPerWarpBlock) + (threadIdx.x >> 5); r < rows;
       r += int64_t(gridDim.x) * kRowsPerWarpBlock) {
    float d[kPer], pr[kPer];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t j = lane + 32 * k;
      d[k] = j < n ? to_float(dprobs[r * n + j]) : 0.f;
      pr[k] = j < n ? to_float(probs[r * n + j]) : 0.f;
      dot += d[k] * pr[k];
    }
    dot = __shfl_sync(0xffffffffu, warp_sum(dot), 0);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t j = lane + 32 * k;
      if (j < n) dscores[r * n + j] = from_float<T>(scale * pr[k] * (d[k] - dot));
    }
  }
}

// Longer rows: one block per row, three passes over global memory.
template <typename T>
__global__ void smax_fwd(const T* scores, const float* mask, T* probs, float scale, SoftmaxShape s,
                         int64_t rows) {
  const int64_t n = s.sk;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = scores + r * n;
    const float* m = mask_row(mask, s, r);
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      mx = fmaxf(mx, to_float(row[j]) * scale + (m != nullptr ? m[j] : 0.f));
    }
    mx = block_reduce<true>(mx);
    if (mx == -INFINITY) {  // every key masked out: attend to nothing
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) probs[r * n + j] = from_float<T>(0.f);
      continue;
    }
    float sum = 0.f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      sum += __expf(to_float(row[j]) * scale + (m != nullptr ? m[j] : 0.f) - mx);
    }
    const float inv = 1.f / block_reduce<false>(sum);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float e = __expf(to_float(row[j]) * scale + (m != nullptr ? m[j] : 0.f) - mx);
      probs[r * n + j] = from_float<T>(e * inv);
    }
  }
}

template <typename T>
__global__ void smax_bwd(const T* dprobs, const T* probs, T* dscores, float scale, int64_t n,
                         int64_t rows) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float dot = 0.f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      dot += to_float(dprobs[r * n + j]) * to_float(probs[r * n + j]);
    }
    dot = block_reduce<false>(dot);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float pr = to_float(probs[r * n + j]);
      dscores[r * n + j] = from_float<T>(scale * pr * (to_float(dprobs[r * n + j]) - dot));
    }
  }
}

int row_grid(int64_t rows) {
  return static_cast<int>(std::max<int64_t>(1, std::min(rows, kMaxGrid)));
}

int elem_grid(int64_t numel) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min((numel + kThreads - 1) / kThreads, kMaxGrid)));
}

// Calls f(T{}) with the CUDA storage type of t.
template <typename F>
void cuda_dispatch(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
  }
}

// 16-byte packs when every pointer is 16-byte aligned and the width divides; else 1 element.
template <typename T>
bool can_pack(int64_t n, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(T);
  if (n % V != 0) return false;
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Calls f(std::integral_constant<int, V>) with the pack width for rows of n elements.
template <typename T, typename F>
void pack_dispatch(int64_t n, std::initializer_list<const void*> ptrs, F&& f) {
  if (can_pack<T>(n, ptrs)) {
    f(std::integral_constant<int, 16 / sizeof(T)>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// The launch shape of the row loops: tx threads over a row's packs (a multiple of 32, at most
// kThreads), kThreads / tx rows per block.
struct RowLaunch {
  dim3 grid, block;
  RowLoop loop;
};

RowLaunch row_launch(int64_t numel, int64_t n, int v) {
  const int64_t packs = n / v, rows = numel / n;
  const int tx = static_cast<int>(std::min<int64_t>(kThreads, (packs + 31) / 32 * 32));
  const int ty = kThreads / tx;
  const int64_t blocks = std::min<int64_t>((rows + ty - 1) / ty, kMaxGrid);
  return {dim3(static_cast<unsigned>(std::max<int64_t>(1, blocks))),
          dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty)), RowLoop{rows, packs}};
}

}  // namespace

int64_t layer_norm_bwd_parts(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>(rows, 1024));
}

#define DS_C(p) static_cast<const T*>(p)
#define DS_M(p) static_cast<T*>(p)

cudaError_t layer_norm_fwd_cuda(DType t, const void* x, const void* gamma, const void* beta,
                                void* y, float* mean, float* rstd, int64_t rows, int64_t h,
                                float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    ln_fwd<T><<<row_grid(rows), kThreads, 0, stream>>>(DS_C(x), DS_C(gamma), DS_C(beta), DS_M(y),
                                                       mean, rstd, rows, h, eps);
  });
  return cudaGetLastError();
}

cudaError_t layer_norm_bwd_cuda(DType t, const void* dy, const void* src, bool src_is_output,
                                const void* gamma, const void* beta, const float* mean,
                                const float* rstd, void* dx, float* dgamma_part, float* dbeta_part,
                                int64_t rows, int64_t h, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int parts = static_cast<int>(layer_norm_bwd_parts(rows));
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    ln_bwd<T><<<parts, kThreads, 0, stream>>>(DS_C(dy), DS_C(src), src_is_output, DS_C(gamma),
                                              DS_C(beta), mean, rstd, DS_M(dx), dgamma_part,
                                              dbeta_part, rows, h);
  });
  return cudaGetLastError();
}

cudaError_t bias_gelu_fwd_cuda(DType t, const void* x, const void* bias, void* y, int64_t numel,
                               int64_t n, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    pack_dispatch<T>(n, {x, bias, y}, [&](auto vc) {
      const RowLaunch l = row_launch(numel, n, vc);
      gelu_fwd<T, vc><<<l.grid, l.block, 0, stream>>>(DS_C(x), DS_C(bias), DS_M(y), l.loop);
    });
  });
  return cudaGetLastError();
}

cudaError_t bias_gelu_bwd_cuda(DType t, const void* dy, const void* x, const void* bias, void* dx,
                               int64_t numel, int64_t n, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    pack_dispatch<T>(n, {dy, x, bias, dx}, [&](auto vc) {
      const RowLaunch l = row_launch(numel, n, vc);
      gelu_bwd<T, vc>
          <<<l.grid, l.block, 0, stream>>>(DS_C(dy), DS_C(x), DS_C(bias), DS_M(dx), l.loop);
    });
  });
  return cudaGetLastError();
}

cudaError_t bias_dropout_residual_cuda(DType t, const void* x, const void* bias,
                                       const void* residual, void* out, float p, uint64_t seed,
                                       uint64_t offset, int64_t numel, int64_t n,
                                       cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    pack_dispatch<T>(n, {x, bias, residual, out}, [&](auto vc) {
      const RowLaunch l = row_launch(numel, n, vc);
      bias_drop_res<T, vc><<<l.grid, l.block, 0, stream>>>(DS_C(x), DS_C(bias), DS_C(residual),
                                                           DS_M(out), p, seed, offset, l.loop);
    });
  });
  return cudaGetLastError();
}

cudaError_t dropout_cuda(DType t, const void* x, void* out, float p, uint64_t seed, uint64_t offset,
                         int64_t numel, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    pack_dispatch<T>(numel, {x, out}, [&](auto vc) {
      const int64_t packs = numel / vc;
      drop<T, vc>
          <<<elem_grid(packs), kThreads, 0, stream>>>(DS_C(x), DS_M(out), p, seed, offset, packs);
    });
  });
  return cudaGetLastError();
}

// Calls f(std::integral_constant<int, kPer>) with the smallest register row (32 * kPer keys)
// that holds n keys; false (nothing called) when n needs more than 1024.
template <typename F>
bool warp_row_dispatch(int64_t n, F&& f) {
  if (n <= 32) return f(std::integral_constant<int, 1>{}), true;
  if (n <= 64) return f(std::integral_constant<int, 2>{}), true;
  if (n <= 128) return f(std::integral_constant<int, 4>{}), true;
  if (n <= 256) return f(std::integral_constant<int, 8>{}), true;
  if (n <= 512) return f(std::integral_constant<int, 16>{}), true;
  if (n <= 1024) return f(std::integral_constant<int, 32>{}), true;
  return false;
}

int warp_row_grid(int64_t rows) {
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((rows + kRowsPerWarpBlock - 1) / kRowsPerWarpBlock, kMaxGrid)));
}

cudaError_t softmax_fwd_cuda(DType t, const void* scores, const float* mask, void* probs,
                             float scale, const SoftmaxShape& s, int64_t rows,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    const bool warp = warp_row_dispatch(s.sk, [&](auto per) {
      smax_fwd_warp<T, per><<<warp_row_grid(rows), 32 * kRowsPerWarpBlock, 0, stream>>>(
          DS_C(scores), mask, DS_M(probs), scale, s, rows);
    });
    if (!warp) {
      smax_fwd<T><<<row_grid(rows), kThreads, 0, stream>>>(DS_C(scores), mask, DS_M(probs), scale,
                                                           s, rows);
    }
  });
  return cudaGetLastError();
}

cudaError_t softmax_bwd_cuda(DType t, const void* dprobs, const void* probs, void* dscores,
                             float scale, int64_t sk, int64_t rows, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    const bool warp = warp_row_dispatch(sk, [&](auto per) {
      smax_bwd_warp<T, per><<<warp_row_grid(rows), 32 * kRowsPerWarpBlock, 0, stream>>>(
          DS_C(dprobs), DS_C(probs), DS_M(dscores), scale, sk, rows);
    });
    if (!warp) {
      smax_bwd<T><<<row_grid(rows), kThreads, 0, stream>>>(DS_C(dprobs), DS_C(probs), DS_M(dscores),
                                                           scale, sk, rows);
    }
  });
  return cudaGetLastError();
}

#undef DS_C
#undef DS_M

}  // namespace ds
