// torch.ops.ds_fused_adam: checks every input, then hands plain pointers to the CUDA core.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_optimizer_checks.h"
#include "fused_adam/fused_adam.h"

namespace {

constexpr const char* kOp = "multi_tensor_adam";

using ds_bind_cuda::to_dtype;

void check_hyper(double lr, double beta1, double beta2, double eps, int64_t step,
                 double weight_decay) {
  ds_bind_cuda::check_adam_hyper(kOp, lr, beta1, beta2, eps, step, weight_decay);
}

void multi_tensor_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, double lr, double beta1, double beta2,
                       double eps, int64_t step, bool adam_w_mode, bool bias_correction,
                       double weight_decay) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, kOp, ": grads has ", grads.size(), " tensors but params has ", n);
  TORCH_CHECK(exp_avgs.size() == n, kOp, ": exp_avgs has ", exp_avgs.size(),
              " tensors but params has ", n);
  TORCH_CHECK(exp_avg_sqs.size() == n, kOp, ": exp_avg_sqs has ", exp_avg_sqs.size(),
              " tensors but params has ", n);
  TORCH_CHECK(n <= size_t(INT_MAX), kOp, ": too many tensors (", n, ")");
  check_hyper(lr, beta1, beta2, eps, step, weight_decay);
  if (n == 0) return;

  const at::Tensor& p0 = params[0];
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    ds_bind_cuda::check_optimizer_tensors(kOp, params, grads, exp_avgs, exp_avg_sqs, i);
    const auto pt = p.scalar_type();
    TORCH_CHECK(grads[i].scalar_type() == pt || grads[i].scalar_type() == at::kFloat, kOp,
                ": grads[", i, "] must be float32 or match params[", i, "] (", pt, "), got ",
                grads[i].scalar_type());
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat, kOp, ": exp_avgs[", i,
                "] must be float32, got ", exp_avgs[i].scalar_type());
    TORCH_CHECK(exp_avg_sqs[i].scalar_type() == at::kFloat, kOp, ": exp_avg_sqs[", i,
                "] must be float32, got ", exp_avg_sqs[i].scalar_type());
  }

  ds::FusedAdamParams hp;
  hp.lr = static_cast<float>(lr);
  hp.beta1 = static_cast<float>(beta1);
  hp.beta2 = static_cast<float>(beta2);
  hp.eps = static_cast<float>(eps);
  hp.weight_decay = static_cast<float>(weight_decay);
  hp.step = step;
  hp.adam_w_mode = adam_w_mode;
  hp.bias_correction = bias_correction;

  const c10::cuda::CUDAGuard guard(p0.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(p0.device().index()).stream();

  // The core takes one (param, grad) dtype pair per launch: run each pair present.
  constexpr at::ScalarType kTypes[] = {at::kFloat, at::kHalf, at::kBFloat16};
  for (const auto pt : kTypes) {
    for (const auto gt : kTypes) {
      if (!ds::fused_adam_supports(to_dtype(pt), to_dtype(gt))) continue;
      std::vector<void*> p, g, m, v;
      std::vector<int64_t> numel;
      for (size_t i = 0; i < n; ++i) {
        if (params[i].scalar_type() != pt || grads[i].scalar_type() != gt) continue;
        p.push_back(params[i].data_ptr());
        g.push_back(const_cast<void*>(grads[i].const_data_ptr()));
        m.push_back(exp_avgs[i].data_ptr());
        v.push_back(exp_avg_sqs[i].data_ptr());
        numel.push_back(params[i].numel());
      }
      if (p.empty()) continue;
      ds::FusedAdamTensors ts;
      ts.n = static_cast<int>(p.size());
      ts.params = p.data();
      ts.grads = g.data();
      ts.exp_avgs = m.data();
      ts.exp_avg_sqs = v.data();
      ts.numel = numel.data();
      C10_CUDA_CHECK(ds::launch_fused_adam(hp, ts, to_dtype(pt), to_dtype(gt), stream));
    }
  }
}

}  // namespace

TORCH_LIBRARY(ds_fused_adam, m) {
  m.def(
      "multi_tensor_adam(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps, int step, "
      "bool adam_w_mode, bool bias_correction, float weight_decay) -> ()");
}

TORCH_LIBRARY_IMPL(ds_fused_adam, CUDA, m) { m.impl("multi_tensor_adam", &multi_tensor_adam); }
