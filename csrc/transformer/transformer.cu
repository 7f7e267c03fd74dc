// CUDA kernels of the fused transformer layer ([Note: transformer kernels]): the CPU kernels'
// math (transformer_core.cpp) with one block per row for the row-wise steps (LayerNorm,
// softmax) and grid-stride loops for the element-wise ones. fp32 math on fp32/fp16/bf16
// storage; dropout masks from [Note: replayed dropout], so CPU and GPU draw the same masks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

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

__device__ __forceinline__ float gelu_tanh(float u) {
  return tanhf(kGeluK * (u + kGeluC * u * u * u));
}

template <typename T>
__global__ void gelu_fwd(const T* x, const T* bias, T* y, int64_t numel, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u = to_float(x[i]) + to_float(bias[i % n]);
    y[i] = from_float<T>(0.5f * u * (1.f + gelu_tanh(u)));
  }
}

template <typename T>
__global__ void gelu_bwd(const T* dy, const T* x, const T* bias, T* dx, int64_t numel, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u = to_float(x[i]) + to_float(bias[i % n]);
    const float t = gelu_tanh(u);
    const float grad =
        0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * kGeluK * (1.f + 3.f * kGeluC * u * u);
    dx[i] = from_float<T>(to_float(dy[i]) * grad);
  }
}

template <typename T>
__global__ void bias_drop_res(const T* x, const T* bias, const T* res, T* out, float p,
                              uint64_t seed, uint64_t offset, int64_t numel, int64_t n) {
  const uint32_t thr = drop_threshold(p);
  const float scale = dropout_scale(p);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = to_float(x[i]) + to_float(bias[i % n]);
    const float kept = dropout_keep(seed, offset + uint64_t(i), thr) ? v * scale : 0.f;
    out[i] = from_float<T>(to_float(res[i]) + kept);
  }
}

template <typename T>
__global__ void drop(const T* x, T* out, float p, uint64_t seed, uint64_t offset, int64_t numel) {
  const uint32_t thr = drop_threshold(p);
  const float scale = dropout_scale(p);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel;
       i += int64_t(gridDim.x) * blockDim.x) {
    const bool keep = dropout_keep(seed, offset + uint64_t(i), thr);
    out[i] = from_float<T>(keep ? to_float(x[i]) * scale : 0.f);
  }
}

template <typename T>
__global__ void smax_fwd(const T* scores, const float* mask, T* probs, float scale, SoftmaxShape s,
                         int64_t rows) {
  const int64_t n = s.sk;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = scores + r * n;
    const float* m = nullptr;
    if (mask != nullptr) m = mask + ((r / s.rows_per_batch) * s.mq + (s.mq > 1 ? r % s.sq : 0)) * n;
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
    gelu_fwd<T><<<elem_grid(numel), kThreads, 0, stream>>>(DS_C(x), DS_C(bias), DS_M(y), numel, n);
  });
  return cudaGetLastError();
}

cudaError_t bias_gelu_bwd_cuda(DType t, const void* dy, const void* x, const void* bias, void* dx,
                               int64_t numel, int64_t n, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    gelu_bwd<T><<<elem_grid(numel), kThreads, 0, stream>>>(DS_C(dy), DS_C(x), DS_C(bias), DS_M(dx),
                                                           numel, n);
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
    bias_drop_res<T><<<elem_grid(numel), kThreads, 0, stream>>>(
        DS_C(x), DS_C(bias), DS_C(residual), DS_M(out), p, seed, offset, numel, n);
  });
  return cudaGetLastError();
}

cudaError_t dropout_cuda(DType t, const void* x, void* out, float p, uint64_t seed, uint64_t offset,
                         int64_t numel, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    drop<T><<<elem_grid(numel), kThreads, 0, stream>>>(DS_C(x), DS_M(out), p, seed, offset, numel);
  });
  return cudaGetLastError();
}

cudaError_t softmax_fwd_cuda(DType t, const void* scores, const float* mask, void* probs,
                             float scale, const SoftmaxShape& s, int64_t rows,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    smax_fwd<T>
        <<<row_grid(rows), kThreads, 0, stream>>>(DS_C(scores), mask, DS_M(probs), scale, s, rows);
  });
  return cudaGetLastError();
}

cudaError_t softmax_bwd_cuda(DType t, const void* dprobs, const void* probs, void* dscores,
                             float scale, int64_t sk, int64_t rows, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cuda_dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    smax_bwd<T><<<row_grid(rows), kThreads, 0, stream>>>(DS_C(dprobs), DS_C(probs), DS_M(dscores),
                                                         scale, sk, rows);
  });
  return cudaGetLastError();
}

#undef DS_C
#undef DS_M

}  // namespace ds
