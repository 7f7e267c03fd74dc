// torch.ops.ds_fused_lion: checks every input, then hands plain pointers to the CUDA core.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <vector>

#include "cuda_optimizer_checks.h"
#include "fused_lion/fused_lion.h"

namespace {

constexpr const char* kOp = "multi_tensor_lion";

using ds_bind_cuda::to_dtype;

void multi_tensor_lion(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       double lr, double beta1, double beta2, double weight_decay) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, kOp, ": grads has ", grads.size(), " tensors but params has ", n);
  TORCH_CHECK(exp_avgs.size() == n, kOp, ": exp_avgs has ", exp_avgs.size(),
              " tensors but params has ", n);
  TORCH_CHECK(n <= size_t(INT_MAX), kOp, ": too many tensors (", n, ")");
  TORCH_CHECK(ds_bind_cuda::finite_nonneg(lr), kOp, ": lr must be finite and >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, kOp, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, kOp, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(ds_bind_cuda::finite_nonneg(weight_decay), kOp,
              ": weight_decay must be finite and >= 0, got ", weight_decay);
  if (n == 0) return;

  const at::Tensor& p0 = params[0];
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    ds_bind_cuda::check_tensor(kOp, p, "params", i, p0, p);
    ds_bind_cuda::check_tensor(kOp, grads[i], "grads", i, p0, p);
    ds_bind_cuda::check_tensor(kOp, exp_avgs[i], "exp_avgs", i, p0, p);
    const auto pt = p.scalar_type();
    TORCH_CHECK(pt == at::kFloat || pt == at::kHalf || pt == at::kBFloat16, kOp, ": params[", i,
                "] must be float32, float16 or bfloat16, got ", pt);
    TORCH_CHECK(grads[i].scalar_type() == pt || grads[i].scalar_type() == at::kFloat, kOp,
                ": grads[", i, "] must be float32 or match params[", i, "] (", pt, "), got ",
                grads[i].scalar_type());
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat, kOp, ": exp_avgs[", i,
                "] must be float32, got ", exp_avgs[i].scalar_type());
  }

  ds::FusedLionParams hp;
  hp.lr = static_cast<float>(lr);
  hp.beta1 = static_cast<float>(beta1);
  hp.beta2 = static_cast<float>(beta2);
  hp.weight_decay = static_cast<float>(weight_decay);

  const c10::cuda::CUDAGuard guard(p0.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(p0.device().index()).stream();

  // The core takes one (param, grad) dtype pair per launch: run each pair present.
  constexpr at::ScalarType kTypes[] = {at::kFloat, at::kHalf, at::kBFloat16};
  for (const auto pt : kTypes) {
    for (const auto gt : kTypes) {
      if (!ds::fused_lion_supports(to_dtype(pt), to_dtype(gt))) continue;
      std::vector<void*> p, g, m;
      std::vector<int64_t> numel;
      for (size_t i = 0; i < n; ++i) {
        if (params[i].scalar_type() != pt || grads[i].scalar_type() != gt) continue;
        p.push_back(params[i].data_ptr());
        g.push_back(const_cast<void*>(grads[i].const_data_ptr()));
        m.push_back(exp_avgs[i].data_ptr());
        numel.push_back(params[i].numel());
      }
      if (p.empty()) continue;
      ds::FusedLionTensors ts;
      ts.n = static_cast<int>(p.size());
      ts.params = p.data();
      ts.grads = g.data();
      ts.exp_avgs = m.data();
      ts.numel = numel.data();
      C10_CUDA_CHECK(ds::launch_fused_lion(hp, ts, to_dtype(pt), to_dtype(gt), stream));
    }
  }
}

}  // namespace

TORCH_LIBRARY(ds_fused_lion, m) {
  m.def(
      "multi_tensor_lion(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, float lr, "
      "float beta1, float beta2, float weight_decay) -> ()");
}

TORCH_LIBRARY_IMPL(ds_fused_lion, CUDA, m) { m.impl("multi_tensor_lion", &multi_tensor_lion); }
