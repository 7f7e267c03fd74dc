// torch binding of the CPU Adam kernel: checks every input, then runs the core in parallel.
#include <torch/library.h>

#include "cpu_adam/cpu_adam.h"
#include "cpu_optimizer_checks.h"
#include "simd.h"

namespace {

void adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool bias_correction, bool adamw_mode) {
  constexpr const char* op = "cpu_adam.adam_step";
  TORCH_CHECK(step >= 1, op, ": step=", step, " must be >= 1");
  ds_bind::check_range(lr, 0.0, 1e30, false, op, "lr");
  ds_bind::check_range(beta1, 0.0, 1.0, true, op, "beta1");
  ds_bind::check_range(beta2, 0.0, 1.0, true, op, "beta2");
  ds_bind::check_range(eps, 0.0, 1e30, false, op, "eps");
  ds_bind::check_range(weight_decay, 0.0, 1e30, false, op, "weight_decay");
  const auto ts =
      ds_bind::check_lists(op, params, grads, exp_avgs, "exp_avgs", &exp_avg_sqs, "exp_avg_sqs");
  const ds::AdamParams hp{lr, beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode};
  ds_bind::run_chunked(ts, [&](const ds_bind::OptTensor& t, int64_t b, int64_t n) {
    using ds_bind::at_elem;
    ds::adam_update(hp, t.pt, at_elem(t.p, t.pt, b), t.gt, at_elem(t.g, t.gt, b), t.st,
                    at_elem(t.s1, t.st, b), at_elem(t.s2, t.st, b), n);
  });
}

std::string simd_level() { return ds::kSimdName; }

}  // namespace

TORCH_LIBRARY(ds_cpu_adam, m) {
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool bias_correction, bool adamw_mode) -> ()",
      &adam_step);
  m.def("simd_level() -> str", &simd_level);
}
