// Sign compression kernels ([Note: sign packing] in packbits.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "packbits_cuda.h"

namespace ds {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 4096 ? (b > 0 ? b : 1) : 4096);  // grid-stride beyond that
}

template <class T>
__global__ void sum_squares_kernel(const T* x, const float* err, int64_t n, double* out) {
  double acc = 0.0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float y = to_f(x[i]) + (err ? err[i] : 0.f);
    acc += double(y) * y;
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  __shared__ double warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kThreads / 32 ? warp_sums[lane] : 0.0;
    for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) atomicAdd(out, acc);
  }
}

// One warp packs 32 consecutive elements per round: a ballot gives their 32 sign bits,
// lanes 0-3 write its 4 bytes.
template <class T>
__global__ void pack_kernel(const T* x, float* err, const float* scale, uint8_t* bits, int64_t n) {
  const float s = *scale;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t bytes = (n + 7) / 8;
  for (int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; w * 32 < n; w += warps) {
    const int64_t i = w * 32 + lane;
    float y = 0.f;
    if (i < n) y = to_f(x[i]) + (err ? err[i] : 0.f);
    const unsigned ballot = __ballot_sync(0xffffffffu, i < n && y >= 0.f);
    if (i < n && err) err[i] = y - (y >= 0.f ? s : -s);
    const int64_t b = w * 4 + lane;
    if (lane < 4 && b < bytes) bits[b] = uint8_t(ballot >> (8 * lane));
  }
}

__global__ void unpack_kernel(const uint8_t* bits, const float* scale, float* out, int64_t n,
                              bool accumulate) {
  const float s = *scale;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = (bits[i >> 3] >> (i & 7)) & 1 ? s : -s;
    out[i] = accumulate ? out[i] + v : v;
  }
}

template <class F>
cudaError_t with_type(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: f(static_cast<const float*>(nullptr)); break;
    case DType::kFloat16: f(static_cast<const __half*>(nullptr)); break;
    case DType::kBFloat16: f(static_cast<const __nv_bfloat16*>(nullptr)); break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_sum_squares(DType t, const void* x, const float* err, int64_t n, double* out,
                               cudaStream_t stream) {
  const cudaError_t e = cudaMemsetAsync(out, 0, sizeof(double), stream);
  if (e != cudaSuccess || n == 0) return e;
  return with_type(t, [&](auto tag) {
    using T = typename std::remove_const<typename std::remove_pointer<decltype(tag)>::type>::type;
    sum_squares_kernel<T>
        <<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), err, n, out);
  });
}

cudaError_t launch_pack_signs(DType t, const void* x, float* err, const float* scale, uint8_t* bits,
                              int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return with_type(t, [&](auto tag) {
    using T = typename std::remove_const<typename std::remove_pointer<decltype(tag)>::type>::type;
    pack_kernel<T>
        <<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), err, scale, bits, n);
  });
}

cudaError_t launch_unpack_signs(const uint8_t* bits, const float* scale, float* out, int64_t n,
                                bool accumulate, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  unpack_kernel<<<blocks_for(n), kThreads, 0, stream>>>(bits, scale, out, n, accumulate);
  return cudaGetLastError();
}

}  // namespace ds
