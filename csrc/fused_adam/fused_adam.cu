// Fused multi-tensor Adam / AdamW kernels. Math: [Note: fused adam math] in fused_adam.h.
#include "fused_adam.h"

#include <cmath>

#include "multi_tensor_apply.cuh"

namespace ds {
namespace {

using mta::kILP;

// Host-derived constants, so the kernel does no pow() per element.
struct AdamScalars {
  float beta1, beta2, eps, weight_decay;
  float step_size;     // lr / bc1
  float bc2_sqrt;      // sqrt(bc2)
  float decay_factor;  // 1 - lr * weight_decay (AdamW)
  bool adam_w_mode;
};

__device__ __forceinline__ void adam_element(float& p, float g, float& m, float& v,
                                             const AdamScalars& s) {
  if (!s.adam_w_mode) g += s.weight_decay * p;
  m = s.beta1 * m + (1.f - s.beta1) * g;
  v = s.beta2 * v + (1.f - s.beta2) * g * g;
  const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;
  if (s.adam_w_mode) p *= s.decay_factor;
  p -= s.step_size * (m / denom);
}

// Table lists: 0 grads, 1 params, 2 exp_avgs, 3 exp_avg_sqs.
template <typename P, typename G>
struct AdamBody {
  AdamScalars s;

  __device__ void operator()(const mta::TensorTable<4>& tab, int t, int64_t /*chunk*/,
                             int64_t start, int64_t len) const {
    const G* g = static_cast<const G*>(tab.ptr[0][t]) + start;
    P* p = static_cast<P*>(tab.ptr[1][t]) + start;
    float* m = static_cast<float*>(tab.ptr[2][t]) + start;
    float* v = static_cast<float*>(tab.ptr[3][t]) + start;

    int64_t done = 0;
    if (mta::vec_aligned(g) && mta::vec_aligned(p) && mta::vec_aligned(m) && mta::vec_aligned(v)) {
      const int64_t vecs = len / kILP;
      for (int64_t k = threadIdx.x; k < vecs; k += blockDim.x) {
        const int64_t i = k * kILP;
        float rg[kILP], rp[kILP], rm[kILP], rv[kILP];
        mta::load_vec(rg, g + i);
        mta::load_vec(rp, p + i);
        mta::load_vec(rm, m + i);
        mta::load_vec(rv, v + i);
#pragma unroll
        for (int e = 0; e < kILP; ++e) adam_element(rp[e], rg[e], rm[e], rv[e], s);
        mta::store_vec(p + i, rp);
        mta::store_vec(m + i, rm);
        mta::store_vec(v + i, rv);
      }
      done = vecs * kILP;
    }
    // Tail of an aligned chunk, or the whole chunk when some tensor is misaligned.
    for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x) {
      float rp = mta::to_float(p[i]);
      float rm = m[i];
      float rv = v[i];
      adam_element(rp, mta::to_float(g[i]), rm, rv, s);
      p[i] = mta::from_float<P>(rp);
      m[i] = rm;
      v[i] = rv;
    }
  }
};

template <typename P, typename G>
cudaError_t run(const AdamScalars& s, const FusedAdamTensors& ts, cudaStream_t stream) {
  const std::array<void* const*, 4> lists{ts.grads, ts.params, ts.exp_avgs, ts.exp_avg_sqs};
  return mta::multi_tensor_apply<4>(ts.n, lists, ts.numel, stream, AdamBody<P, G>{s});
}

}  // namespace

bool fused_adam_supports(DType param, DType grad) {
  return grad == param || grad == DType::kFloat32;
}

cudaError_t launch_fused_adam(const FusedAdamParams& hp, const FusedAdamTensors& tensors,
                              DType param_dtype, DType grad_dtype, cudaStream_t stream) {
  if (!fused_adam_supports(param_dtype, grad_dtype)) return cudaErrorInvalidValue;
  if (tensors.n == 0) return cudaSuccess;

  // Bias corrections in double: beta2^step loses digits in fp32 for large steps.
  const double step = static_cast<double>(hp.step);
  const double bc1 = hp.bias_correction ? 1.0 - std::pow(double(hp.beta1), step) : 1.0;
  const double bc2 = hp.bias_correction ? 1.0 - std::pow(double(hp.beta2), step) : 1.0;
  AdamScalars s;
  s.beta1 = hp.beta1;
  s.beta2 = hp.beta2;
  s.eps = hp.eps;
  s.weight_decay = hp.weight_decay;
  s.step_size = static_cast<float>(double(hp.lr) / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.decay_factor = static_cast<float>(1.0 - double(hp.lr) * double(hp.weight_decay));
  s.adam_w_mode = hp.adam_w_mode;

  const bool grad_fp32 = grad_dtype == DType::kFloat32;
  switch (param_dtype) {
    case DType::kFloat32: return run<float, float>(s, tensors, stream);
    case DType::kFloat16:
      return grad_fp32 ? run<__half, float>(s, tensors, stream)
                       : run<__half, __half>(s, tensors, stream);
    case DType::kBFloat16:
      return grad_fp32 ? run<__nv_bfloat16, float>(s, tensors, stream)
                       : run<__nv_bfloat16, __nv_bfloat16>(s, tensors, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ds
