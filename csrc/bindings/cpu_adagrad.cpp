// torch binding of the CPU Adagrad kernel: checks every input, then runs the core in parallel.
#include <torch/library.h>

#include "cpu_adagrad/cpu_adagrad.h"
#include "cpu_optimizer_checks.h"
#include "simd.h"

namespace {

void adagrad_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avg_sqs,
                  double lr, double eps, double weight_decay) {
  constexpr const char* op = "cpu_adagrad.adagrad_step";
  ds_bind::check_range(lr, 0.0, 1e30, false, op, "lr");
  ds_bind::check_range(eps, 0.0, 1e30, false, op, "eps");
  ds_bind::check_range(weight_decay, 0.0, 1e30, false, op, "weight_decay");
  const auto ts = ds_bind::check_lists(op, params, grads, exp_avg_sqs, "exp_avg_sqs", nullptr, "");
  const ds::AdagradParams hp{lr, eps, weight_decay};
  ds_bind::run_chunked(ts, [&](const ds_bind::OptTensor& t, int64_t b, int64_t n) {
    using ds_bind::at_elem;
    ds::adagrad_update(hp, t.pt, at_elem(t.p, t.pt, b), t.gt, at_elem(t.g, t.gt, b), t.st,
                       at_elem(t.s1, t.st, b), n);
  });
}

std::string simd_level() { return ds::kSimdName; }

}  // namespace

TORCH_LIBRARY(ds_cpu_adagrad, m) {
  m.def(
      "adagrad_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avg_sqs, float lr, "
      "float eps, float weight_decay) -> ()",
      &adagrad_step);
  m.def("simd_level() -> str", &simd_level);
}
