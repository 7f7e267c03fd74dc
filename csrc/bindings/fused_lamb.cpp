// torch.ops.ds_fused_lamb: checks every input, then hands plain pointers to the CUDA core.
// Math: [Note: lamb math] in fused_lamb/fused_lamb.h.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_optimizer_checks.h"
#include "fused_lamb/fused_lamb.h"

namespace {

constexpr const char* kOp = "multi_tensor_lamb";

using ds_bind_cuda::finite_nonneg;
using ds_bind_cuda::to_dtype;

void check_hyper(const ds::FusedLambParams& hp, double lr, double beta1, double beta2, double eps,
                 double weight_decay, double grad_scale, double max_coeff, double min_coeff) {
  ds_bind_cuda::check_adam_hyper(kOp, lr, beta1, beta2, eps, hp.step, weight_decay);
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale > 0, kOp,
              ": grad_scale must be finite and > 0, got ", grad_scale);
  TORCH_CHECK(finite_nonneg(min_coeff), kOp, ": min_coeff must be finite and >= 0, got ",
              min_coeff);
  TORCH_CHECK(std::isfinite(max_coeff) && max_coeff >= min_coeff, kOp,
              ": max_coeff must be finite and >= min_coeff (", min_coeff, "), got ", max_coeff);
}

// Returns a float32 tensor of the n trust ratios, on the params' device.
at::Tensor multi_tensor_lamb(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                             at::TensorList exp_avg_sqs, double lr, double beta1, double beta2,
                             double eps, int64_t step, bool bias_correction, double weight_decay,
                             bool eps_inside_sqrt, double grad_scale, double max_coeff,
                             double min_coeff) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, kOp, ": grads has ", grads.size(), " tensors but params has ", n);
  TORCH_CHECK(exp_avgs.size() == n, kOp, ": exp_avgs has ", exp_avgs.size(),
              " tensors but params has ", n);
  TORCH_CHECK(exp_avg_sqs.size() == n, kOp, ": exp_avg_sqs has ", exp_avg_sqs.size(),
              " tensors but params has ", n);
  TORCH_CHECK(n <= size_t(INT_MAX), kOp, ": too many tensors (", n, ")");

  ds::FusedLambParams hp;
  hp.lr = static_cast<float>(lr);
  hp.beta1 = static_cast<float>(beta1);
  hp.beta2 = static_cast<float>(beta2);
  hp.eps = static_cast<float>(eps);
  hp.weight_decay = static_cast<float>(weight_decay);
  hp.grad_scale = static_cast<float>(grad_scale);
  hp.max_coeff = static_cast<float>(max_coeff);
  hp.min_coeff = static_cast<float>(min_coeff);
  hp.step = step;
  hp.bias_correction = bias_correction;
  hp.eps_inside_sqrt = eps_inside_sqrt;
  check_hyper(hp, lr, beta1, beta2, eps, weight_decay, grad_scale, max_coeff, min_coeff);
  if (n == 0) return at::empty({0}, at::TensorOptions().dtype(at::kFloat));

  const at::Tensor& p0 = params[0];
  std::vector<int64_t> numel(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    ds_bind_cuda::check_optimizer_tensors(kOp, params, grads, exp_avgs, exp_avg_sqs, i);
    const auto pt = p.scalar_type();
    const auto gt = grads[i].scalar_type();
    TORCH_CHECK(gt == pt || gt == at::kFloat ||
                    (pt == at::kFloat && (gt == at::kHalf || gt == at::kBFloat16)),
                kOp, ": grads[", i, "] must be float32 or match params[", i, "] (", pt,
                "), or be float16/bfloat16 for float32 params; got ", gt);
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat, kOp, ": exp_avgs[", i,
                "] must be float32, got ", exp_avgs[i].scalar_type());
    TORCH_CHECK(exp_avg_sqs[i].scalar_type() == at::kFloat, kOp, ": exp_avg_sqs[", i,
                "] must be float32, got ", exp_avg_sqs[i].scalar_type());
    numel[i] = p.numel();
  }

  const c10::cuda::CUDAGuard guard(p0.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(p0.device().index()).stream();
  const auto f32 = p0.options().dtype(at::kFloat);
  at::Tensor coeffs = at::empty({int64_t(n)}, f32);
  // Sized for all tensors, so every dtype pair below can reuse it in stream order.
  at::Tensor workspace = at::empty({ds::fused_lamb_workspace_floats(int(n), numel.data())}, f32);
  float* coeff0 = coeffs.data_ptr<float>();

  // The core takes one (param, grad) dtype pair per launch: run each pair present. Each
  // tensor's coeff slot points at its own index, so coeffs keeps the caller's order.
  constexpr at::ScalarType kTypes[] = {at::kFloat, at::kHalf, at::kBFloat16};
  for (const auto pt : kTypes) {
    for (const auto gt : kTypes) {
      if (!ds::fused_lamb_supports(to_dtype(pt), to_dtype(gt))) continue;
      std::vector<void*> p, g, m, v, c;
      std::vector<int64_t> sizes;
      for (size_t i = 0; i < n; ++i) {
        if (params[i].scalar_type() != pt || grads[i].scalar_type() != gt) continue;
        p.push_back(params[i].data_ptr());
        g.push_back(const_cast<void*>(grads[i].const_data_ptr()));
        m.push_back(exp_avgs[i].data_ptr());
        v.push_back(exp_avg_sqs[i].data_ptr());
        c.push_back(coeff0 + i);
        sizes.push_back(numel[i]);
      }
      if (p.empty()) continue;
      ds::FusedLambTensors ts;
      ts.n = static_cast<int>(p.size());
      ts.params = p.data();
      ts.grads = g.data();
      ts.exp_avgs = m.data();
      ts.exp_avg_sqs = v.data();
      ts.coeffs = c.data();
      ts.numel = sizes.data();
      C10_CUDA_CHECK(ds::launch_fused_lamb(hp, ts, to_dtype(pt), to_dtype(gt),
                                           workspace.data_ptr<float>(), stream));
    }
  }
  return coeffs;
}

}  // namespace

TORCH_LIBRARY(ds_fused_lamb, m) {
  m.def(
      "multi_tensor_lamb(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps, int step, "
      "bool bias_correction, float weight_decay, bool eps_inside_sqrt, float grad_scale, "
      "float max_coeff, float min_coeff) -> Tensor");
}

TORCH_LIBRARY_IMPL(ds_fused_lamb, CUDA, m) { m.impl("multi_tensor_lamb", &multi_tensor_lamb); }
