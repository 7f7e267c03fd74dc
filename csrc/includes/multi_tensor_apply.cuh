// Multi-tensor apply: run one elementwise "body" over many tensors with few kernel launches.
//
// [Note: multi tensor apply]
// An optimizer step touches hundreds of tensors; one launch per tensor costs more in launch
// latency than the arithmetic. Here the host packs up to TensorTable<D>::kCapacity tensors
// (D parallel pointer lists, e.g. grad/param/exp_avg/exp_avg_sq) into a table that travels
// by value as a kernel argument, so no host-to-device copy precedes the launch. The table
// stays under kTableBytes so that it, the body functor and extra arguments fit the 4 KB
// kernel parameter limit. More tensors than one table holds take more launches.
//
// Each tensor is cut into chunks of kChunkSize elements; chunk ids run over the whole table
// (chunk_end is the running count). Blocks grid-stride over the table's chunks, so a table
// may hold any number of chunks and a tensor is never split across launches: per-tensor
// reductions (LAMB's norms) stay inside one table. Per-chunk and per-tensor outputs are
// indexed with chunk_base / tensor_base, the table's offsets within the whole call.
//
// Torch-free: plain pointers and a caller-given cudaStream_t.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "cuda_convert.cuh"

namespace ds {
namespace mta {

constexpr int kParamLimitBytes = 4096;  // portable __global__ parameter limit
constexpr int kTableBytes = 3584;       // the rest is left for the body and its arguments
constexpr int64_t kChunkSize = 65536;   // elements per chunk; a multiple of every vector width
constexpr int kBlockThreads = 512;
constexpr int kILP = 4;  // elements per thread per vector load

template <int kDepth>
struct TensorTable {
  static constexpr int kHeaderBytes = 16;  // chunk_base, tensor_base, num_tensors
  static constexpr int kCapacity = (kTableBytes - kHeaderBytes) / (8 * (kDepth + 2));

  void* ptr[kDepth][kCapacity];
  int64_t numel[kCapacity];
  int64_t chunk_end[kCapacity];  // chunks of tensors [0, t], counted within this table
  int64_t chunk_base;            // index of this table's first chunk within the call
  int32_t tensor_base;           // index of this table's first tensor within the call
  int32_t num_tensors;

  __host__ __device__ int64_t num_chunks() const {
    return num_tensors > 0 ? chunk_end[num_tensors - 1] : 0;
  }
  __host__ __device__ int64_t chunk_begin(int t) const { return t > 0 ? chunk_end[t - 1] : 0; }
};

static_assert(sizeof(TensorTable<4>) <= kTableBytes && sizeof(TensorTable<5>) <= kTableBytes,
              "a table must fit its share of the parameter budget");
static_assert(kChunkSize % (kILP * 4) == 0, "chunks must keep vector alignment");

// Packs n tensors (lists[d][i] is list d's pointer for tensor i) into tables and calls
// on_table(table) for each. Empty tensors are kept (with no chunks) so that per-tensor
// outputs still see them. Stops at, and returns, the first error on_table returns.
template <int kDepth, typename OnTable>
cudaError_t for_each_table(int n, const std::array<void* const*, kDepth>& lists,
                           const int64_t* numel, OnTable&& on_table) {
  using Table = TensorTable<kDepth>;
  Table table{};
  int64_t chunks_before = 0;  // chunks of tensors already in earlier tables
  for (int i = 0; i < n; ++i) {
    const int slot = table.num_tensors;
    for (int d = 0; d < kDepth; ++d) table.ptr[d][slot] = lists[d][i];
    table.numel[slot] = numel[i];
    const int64_t chunks = (numel[i] + kChunkSize - 1) / kChunkSize;
    table.chunk_end[slot] = table.chunk_begin(slot) + chunks;
    table.num_tensors = slot + 1;
    if (table.num_tensors == Table::kCapacity || i == n - 1) {
      const cudaError_t err = on_table(static_cast<const Table&>(table));
      if (err != cudaSuccess) return err;
      chunks_before += table.num_chunks();
      table.num_tensors = 0;
      table.tensor_base = i + 1;
      table.chunk_base = chunks_before;
    }
  }
  return cudaSuccess;
}

// Enough blocks to fill the device once; more would only queue behind the grid-stride loop.
inline cudaError_t resident_blocks(int threads, int* blocks) {
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, dev);
  }
  *blocks = std::max(1, sms) * std::max(1, per_sm / threads);
  return err;
}

// The generic kernel: body(table, t, chunk, start, len, args...) is called block-wide for
// chunk `chunk` (table-local) of tensor t, covering elements [start, start + len). The loop
// condition is uniform across the block, so bodies may use __syncthreads().
template <int kDepth, typename Body, typename... Args>
__global__ void __launch_bounds__(kBlockThreads)
    apply_kernel(TensorTable<kDepth> table, Body body, Args... args) {
  const int64_t n = table.num_chunks();
  int t = 0;
  for (int64_t c = blockIdx.x; c < n; c += gridDim.x) {
    while (c >= table.chunk_end[t]) ++t;  // chunks only grow, so t only moves forward
    const int64_t start = (c - table.chunk_begin(t)) * kChunkSize;
    const int64_t rest = table.numel[t] - start;
    const int64_t len = rest < kChunkSize ? rest : kChunkSize;
    body(table, t, c, start, len, args...);
  }
}

// Launches apply_kernel over one table (nothing for a table without elements).
template <int kDepth, typename Body, typename... Args>
cudaError_t launch_table(const TensorTable<kDepth>& table, int max_blocks, cudaStream_t stream,
                         Body body, Args... args) {
  const int64_t chunks = table.num_chunks();
  if (chunks == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>(chunks, max_blocks));
  apply_kernel<kDepth, Body, Args...><<<blocks, kBlockThreads, 0, stream>>>(table, body, args...);
  return cudaGetLastError();
}

// The common case: one body over all tensors, a launch per table.
template <int kDepth, typename Body, typename... Args>
cudaError_t multi_tensor_apply(int n, const std::array<void* const*, kDepth>& lists,
                               const int64_t* numel, cudaStream_t stream, Body body, Args... args) {
  int max_blocks = 0;
  cudaError_t err = resident_blocks(kBlockThreads, &max_blocks);
  if (err != cudaSuccess) return err;
  return for_each_table<kDepth>(n, lists, numel, [&](const TensorTable<kDepth>& table) {
    return launch_table(table, max_blocks, stream, body, args...);
  });
}

// ---- element access: fp32 math on fp32 / fp16 / bf16 storage ------------------------------
using cvt::from_float;
using cvt::to_float;

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// True when ptr can be read kILP elements at a time. Chunk starts are multiples of kILP
// elements from the tensor start, so the tensor's own alignment decides.
template <typename T>
__device__ __forceinline__ bool vec_aligned(const T* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % (sizeof(T) * kILP) == 0;
}

template <typename T>
__device__ __forceinline__ void load_vec(float (&out)[kILP], const T* src) {
  const Pack<T, kILP> pk = *reinterpret_cast<const Pack<T, kILP>*>(src);
#pragma unroll
  for (int i = 0; i < kILP; ++i) out[i] = to_float(pk.v[i]);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* dst, const float (&in)[kILP]) {
  Pack<T, kILP> pk;
#pragma unroll
  for (int i = 0; i < kILP; ++i) pk.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, kILP>*>(dst) = pk;
}

// ---- block reduction ------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
  return x;
}

// Sums a and b over the block; the totals are valid in thread 0. Every thread must call it.
// The summation order is fixed by the block shape, so results are run-to-run deterministic.
__device__ __forceinline__ void block_sum2(float& a, float& b) {
  __shared__ float sa[32];
  __shared__ float sb[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  __syncthreads();  // a previous call's reads of sa/sb are done before we overwrite them
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) >> 5;
    a = warp_sum(lane < warps ? sa[lane] : 0.f);
    b = warp_sum(lane < warps ? sb[lane] : 0.f);
  }
}

}  // namespace mta
}  // namespace ds
