// torch binding of the CPU Lion kernel: checks every input, then runs the core in parallel.
#include <torch/library.h>

#include "cpu_lion/cpu_lion.h"
#include "cpu_optimizer_checks.h"
#include "simd.h"

namespace {

void lion_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, double lr,
               double beta1, double beta2, double weight_decay) {
  constexpr const char* op = "cpu_lion.lion_step";
  ds_bind::check_range(lr, 0.0, 1e30, false, op, "lr");
  ds_bind::check_range(beta1, 0.0, 1.0, false, op, "beta1");
  ds_bind::check_range(beta2, 0.0, 1.0, false, op, "beta2");
  ds_bind::check_range(weight_decay, 0.0, 1e30, false, op, "weight_decay");
  const auto ts = ds_bind::check_lists(op, params, grads, exp_avgs, "exp_avgs", nullptr, "");
  const ds::LionParams hp{lr, beta1, beta2, weight_decay};
  ds_bind::run_chunked(ts, [&](const ds_bind::OptTensor& t, int64_t b, int64_t n) {
    using ds_bind::at_elem;
    ds::lion_update(hp, t.pt, at_elem(t.p, t.pt, b), t.gt, at_elem(t.g, t.gt, b), t.st,
                    at_elem(t.s1, t.st, b), n);
  });
}

std::string simd_level() { return ds::kSimdName; }

}  // namespace

TORCH_LIBRARY(ds_cpu_lion, m) {
  m.def(
      "lion_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, float lr, "
      "float beta1, float beta2, float weight_decay) -> ()",
      &lion_step);
  m.def("simd_level() -> str", &simd_level);
}
