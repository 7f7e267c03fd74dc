// Fused multi-tensor LAMB kernels. Math: [Note: lamb math] in fused_lamb.h.
//
// Two passes over the data per table of tensors, with a small reduction between them:
//   phase 1  moments m, v written back; per chunk, sum(p^2) and sum(u^2) to a workspace
//   reduce   one block per tensor sums its chunks' partials (fixed order: deterministic)
//            and writes the tensor's trust ratio to its coeff slot
//   phase 2  u is recomputed from the stored m, v and the unchanged p, then p -= ... * u
// Recomputing u costs a read of m and v but no extra buffer the size of the params.
// A tensor never straddles two tables (see [Note: multi tensor apply]), so each table's
// three launches are complete for its tensors.
#include "fused_lamb.h"

#include <cmath>

#include "multi_tensor_apply.cuh"

namespace ds {
namespace {

using mta::kILP;
using Table = mta::TensorTable<5>;  // lists: 0 grads, 1 params, 2 exp_avgs, 3 exp_avg_sqs, 4 coeffs

constexpr int kReduceThreads = 256;

struct LambScalars {
  float beta1, beta2, eps, weight_decay, grad_scale;
  float step_size;  // lr * sqrt(bc2) / bc1, or lr
  bool eps_inside_sqrt;
};

__device__ __forceinline__ void lamb_moments(float g, float& m, float& v, const LambScalars& s) {
  g = g / s.grad_scale;
  m = s.beta1 * m + (1.f - s.beta1) * g;
  v = s.beta2 * v + (1.f - s.beta2) * g * g;
}

__device__ __forceinline__ float lamb_update(float p, float m, float v, const LambScalars& s) {
  const float denom = s.eps_inside_sqrt ? sqrtf(v + s.eps) : sqrtf(v) + s.eps;
  return m / denom + s.weight_decay * p;
}

template <typename T>
__device__ __forceinline__ T* list(const Table& tab, int d, int t, int64_t start) {
  return static_cast<T*>(tab.ptr[d][t]) + start;
}

template <typename P, typename G>
__device__ __forceinline__ bool all_aligned(const Table& tab, int t, int64_t start) {
  return mta::vec_aligned(list<const G>(tab, 0, t, start)) &&
         mta::vec_aligned(list<P>(tab, 1, t, start)) &&
         mta::vec_aligned(list<float>(tab, 2, t, start)) &&
         mta::vec_aligned(list<float>(tab, 3, t, start));
}

// Phase 1: moments, and this chunk's sum(p^2), sum(u^2) into partials[2 * chunk + {0, 1}].
template <typename P, typename G>
struct MomentsBody {
  LambScalars s;

  __device__ void operator()(const Table& tab, int t, int64_t chunk, int64_t start, int64_t len,
                             float* partials) const {
    const G* g = list<const G>(tab, 0, t, start);
    const P* p = list<P>(tab, 1, t, start);
    float* m = list<float>(tab, 2, t, start);
    float* v = list<float>(tab, 3, t, start);
    float w2 = 0.f, u2 = 0.f;

    int64_t done = 0;
    if (all_aligned<P, G>(tab, t, start)) {
      const int64_t vecs = len / kILP;
      for (int64_t k = threadIdx.x; k < vecs; k += blockDim.x) {
        const int64_t i = k * kILP;
        float rg[kILP], rp[kILP], rm[kILP], rv[kILP];
        mta::load_vec(rg, g + i);
        mta::load_vec(rp, p + i);
        mta::load_vec(rm, m + i);
        mta::load_vec(rv, v + i);
#pragma unroll
        for (int e = 0; e < kILP; ++e) {
          lamb_moments(rg[e], rm[e], rv[e], s);
          const float u = lamb_update(rp[e], rm[e], rv[e], s);
          w2 += rp[e] * rp[e];
          u2 += u * u;
        }
        mta::store_vec(m + i, rm);
        mta::store_vec(v + i, rv);
      }
      done = vecs * kILP;
    }
    for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x) {
      const float rp = mta::to_float(p[i]);
      float rm = m[i];
      float rv = v[i];
      lamb_moments(mta::to_float(g[i]), rm, rv, s);
      const float u = lamb_update(rp, rm, rv, s);
      w2 += rp * rp;
      u2 += u * u;
      m[i] = rm;
      v[i] = rv;
    }

    mta::block_sum2(w2, u2);
    if (threadIdx.x == 0) {
      const int64_t c = tab.chunk_base + chunk;
      partials[2 * c] = w2;
      partials[2 * c + 1] = u2;
    }
  }
};

// One block per tensor of the table: norms from the partials, then the trust ratio.
__global__ void __launch_bounds__(kReduceThreads)
    lamb_coeff_kernel(Table tab, const float* partials, float max_coeff, float min_coeff) {
  const int t = blockIdx.x;
  const int64_t begin = tab.chunk_base + tab.chunk_begin(t);
  const int64_t end = tab.chunk_base + tab.chunk_end[t];
  float w2 = 0.f, u2 = 0.f;
  for (int64_t c = begin + threadIdx.x; c < end; c += blockDim.x) {
    w2 += partials[2 * c];
    u2 += partials[2 * c + 1];
  }
  mta::block_sum2(w2, u2);
  if (threadIdx.x == 0) {
    const float w_norm = sqrtf(w2);
    const float u_norm = sqrtf(u2);
    float coeff = 1.f;
    if (w_norm != 0.f && u_norm != 0.f) {
      coeff = w_norm / u_norm;
      if (coeff > max_coeff) coeff = max_coeff;
      if (coeff < min_coeff) coeff = min_coeff;
    }
    *static_cast<float*>(tab.ptr[4][t]) = coeff;
  }
}

// Phase 2: p -= step_size * coeff * u, with u rebuilt exactly as phase 1 built it.
template <typename P, typename G>
struct ApplyBody {
  LambScalars s;

  __device__ void operator()(const Table& tab, int t, int64_t /*chunk*/, int64_t start,
                             int64_t len) const {
    P* p = list<P>(tab, 1, t, start);
    const float* m = list<const float>(tab, 2, t, start);
    const float* v = list<const float>(tab, 3, t, start);
    const float scale = s.step_size * *static_cast<const float*>(tab.ptr[4][t]);

    int64_t done = 0;
    if (all_aligned<P, G>(tab, t, start)) {
      const int64_t vecs = len / kILP;
      for (int64_t k = threadIdx.x; k < vecs; k += blockDim.x) {
        const int64_t i = k * kILP;
        float rp[kILP], rm[kILP], rv[kILP];
        mta::load_vec(rp, p + i);
        mta::load_vec(rm, m + i);
        mta::load_vec(rv, v + i);
#pragma unroll
        for (int e = 0; e < kILP; ++e) rp[e] -= scale * lamb_update(rp[e], rm[e], rv[e], s);
        mta::store_vec(p + i, rp);
      }
      done = vecs * kILP;
    }
    for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x) {
      const float rp = mta::to_float(p[i]);
      p[i] = mta::from_float<P>(rp - scale * lamb_update(rp, m[i], v[i], s));
    }
  }
};

template <typename P, typename G>
cudaError_t run(const FusedLambParams& hp, const LambScalars& s, const FusedLambTensors& ts,
                float* workspace, cudaStream_t stream) {
  int max_blocks = 0;
  cudaError_t err = mta::resident_blocks(mta::kBlockThreads, &max_blocks);
  if (err != cudaSuccess) return err;
  const std::array<void* const*, 5> lists{ts.grads, ts.params, ts.exp_avgs, ts.exp_avg_sqs,
                                          ts.coeffs};
  return mta::for_each_table<5>(ts.n, lists, ts.numel, [&](const Table& tab) {
    cudaError_t e = mta::launch_table(tab, max_blocks, stream, MomentsBody<P, G>{s}, workspace);
    if (e != cudaSuccess) return e;
    lamb_coeff_kernel<<<tab.num_tensors, kReduceThreads, 0, stream>>>(tab, workspace, hp.max_coeff,
                                                                      hp.min_coeff);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    return mta::launch_table(tab, max_blocks, stream, ApplyBody<P, G>{s});
  });
}

}  // namespace

bool fused_lamb_supports(DType param, DType grad) {
  return grad == param || grad == DType::kFloat32 || param == DType::kFloat32;
}

int64_t fused_lamb_workspace_floats(int n, const int64_t* numel) {
  int64_t chunks = 0;
  for (int i = 0; i < n; ++i) chunks += (numel[i] + mta::kChunkSize - 1) / mta::kChunkSize;
  return 2 * chunks;
}

cudaError_t launch_fused_lamb(const FusedLambParams& hp, const FusedLambTensors& tensors,
                              DType param_dtype, DType grad_dtype, float* workspace,
                              cudaStream_t stream) {
  if (!fused_lamb_supports(param_dtype, grad_dtype)) return cudaErrorInvalidValue;
  if (tensors.n == 0) return cudaSuccess;

  LambScalars s;
  s.beta1 = hp.beta1;
  s.beta2 = hp.beta2;
  s.eps = hp.eps;
  s.weight_decay = hp.weight_decay;
  s.grad_scale = hp.grad_scale;
  s.eps_inside_sqrt = hp.eps_inside_sqrt;
  s.step_size = hp.lr;
  if (hp.bias_correction) {
    // In double: beta2^step loses digits in fp32 for large steps.
    const double step = static_cast<double>(hp.step);
    const double bc1 = 1.0 - std::pow(double(hp.beta1), step);
    const double bc2 = 1.0 - std::pow(double(hp.beta2), step);
    s.step_size = static_cast<float>(double(hp.lr) * std::sqrt(bc2) / bc1);
  }

  const bool grad_fp32 = grad_dtype == DType::kFloat32;
  switch (param_dtype) {
    case DType::kFloat32:
      if (grad_dtype == DType::kFloat16) {
        return run<float, __half>(hp, s, tensors, workspace, stream);
      }
      if (grad_dtype == DType::kBFloat16) {
        return run<float, __nv_bfloat16>(hp, s, tensors, workspace, stream);
      }
      return run<float, float>(hp, s, tensors, workspace, stream);
    case DType::kFloat16:
      return grad_fp32 ? run<__half, float>(hp, s, tensors, workspace, stream)
                       : run<__half, __half>(hp, s, tensors, workspace, stream);
    case DType::kBFloat16:
      return grad_fp32 ? run<__nv_bfloat16, float>(hp, s, tensors, workspace, stream)
                       : run<__nv_bfloat16, __nv_bfloat16>(hp, s, tensors, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ds
