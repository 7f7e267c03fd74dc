// Fused multi-tensor Lion kernels. Math: [Note: fused lion math] in fused_lion.h.
#include "fused_lion.h"

#include "multi_tensor_apply.cuh"

namespace ds {
namespace {

using mta::kILP;

struct LionScalars {
  float lr, beta1, beta2, decay_factor;  // decay_factor = 1 - lr * weight_decay
};

__device__ __forceinline__ void lion_element(float& p, float g, float& m, const LionScalars& s) {
  const float c = s.beta1 * m + (1.f - s.beta1) * g;
  const float dir = c > 0.f ? 1.f : (c < 0.f ? -1.f : 0.f);
  p = p * s.decay_factor - s.lr * dir;
  m = s.beta2 * m + (1.f - s.beta2) * g;
}

// Table lists: 0 grads, 1 params, 2 exp_avgs.
template <typename P, typename G>
struct LionBody {
  LionScalars s;

  __device__ void operator()(const mta::TensorTable<3>& tab, int t, int64_t /*chunk*/,
                             int64_t start, int64_t len) const {
    const G* g = static_cast<const G*>(tab.ptr[0][t]) + start;
    P* p = static_cast<P*>(tab.ptr[1][t]) + start;
    float* m = static_cast<float*>(tab.ptr[2][t]) + start;

    int64_t done = 0;
    if (mta::vec_aligned(g) && mta::vec_aligned(p) && mta::vec_aligned(m)) {
      const int64_t vecs = len / kILP;
      for (int64_t k = threadIdx.x; k < vecs; k += blockDim.x) {
        const int64_t i = k * kILP;
        float rg[kILP], rp[kILP], rm[kILP];
        mta::load_vec(rg, g + i);
        mta::load_vec(rp, p + i);
        mta::load_vec(rm, m + i);
#pragma unroll
        for (int e = 0; e < kILP; ++e) lion_element(rp[e], rg[e], rm[e], s);
        mta::store_vec(p + i, rp);
        mta::store_vec(m + i, rm);
      }
      done = vecs * kILP;
    }
    // Tail of an aligned chunk, or the whole chunk when some tensor is misaligned.
    for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x) {
      float rp = mta::to_float(p[i]);
      float rm = m[i];
      lion_element(rp, mta::to_float(g[i]), rm, s);
      p[i] = mta::from_float<P>(rp);
      m[i] = rm;
    }
  }
};

template <typename P, typename G>
cudaError_t run(const LionScalars& s, const FusedLionTensors& ts, cudaStream_t stream) {
  const std::array<void* const*, 3> lists{ts.grads, ts.params, ts.exp_avgs};
  return mta::multi_tensor_apply<3>(ts.n, lists, ts.numel, stream, LionBody<P, G>{s});
}

}  // namespace

bool fused_lion_supports(DType param, DType grad) {
  return grad == param || grad == DType::kFloat32;
}

cudaError_t launch_fused_lion(const FusedLionParams& hp, const FusedLionTensors& tensors,
                              DType param_dtype, DType grad_dtype, cudaStream_t stream) {
  if (!fused_lion_supports(param_dtype, grad_dtype)) return cudaErrorInvalidValue;
  if (tensors.n == 0) return cudaSuccess;
  LionScalars s;
  s.lr = hp.lr;
  s.beta1 = hp.beta1;
  s.beta2 = hp.beta2;
  s.decay_factor = static_cast<float>(1.0 - double(hp.lr) * double(hp.weight_decay));

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
