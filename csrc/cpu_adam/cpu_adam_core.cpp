#include "cpu_adam/cpu_adam.h"

#include <cmath>

#include "simd.h"

namespace ds {
namespace {

struct AdamCoeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float step_size;     // lr / (1 - beta1^t)
  float bc2_rsqrt;     // 1 / sqrt(1 - beta2^t)
  float l2;            // weight decay added to the gradient (Adam mode), else 0
  float decay_factor;  // 1 - lr * wd (AdamW mode), else 1
};

AdamCoeffs coeffs(const AdamParams& hp) {
  const double t = double(hp.step);
  const double bc1 = hp.bias_correction ? 1.0 - std::pow(hp.beta1, t) : 1.0;
  const double bc2 = hp.bias_correction ? 1.0 - std::pow(hp.beta2, t) : 1.0;
  return {float(hp.beta1),
          float(1.0 - hp.beta1),
          float(hp.beta2),
          float(1.0 - hp.beta2),
          float(hp.eps),
          float(hp.lr / bc1),
          float(1.0 / std::sqrt(bc2)),
          hp.adamw_mode ? 0.f : float(hp.weight_decay),
          hp.adamw_mode ? float(1.0 - hp.lr * hp.weight_decay) : 1.f};
}

template <class P, class G, class S>
void update(const AdamCoeffs& coeffs_in, P* p, const G* g, S* m, S* v, int64_t n) {
  // By value: stores through p/m/v could alias a referenced struct, which would force a
  // reload and re-broadcast of every coefficient for every vector.
  const AdamCoeffs c = coeffs_in;
  for_each_lane(n, [c, p, g, m, v](auto ops, int64_t i) {
    using O = decltype(ops);
    auto gv = O::load(g + i);
    auto pv = O::load(p + i);
    if (c.l2 != 0.f) gv = O::fma(pv, O::set1(c.l2), gv);
    auto mv = O::fma(O::load(m + i), O::set1(c.beta1), O::mul(gv, O::set1(c.one_minus_beta1)));
    // ((1 - beta2) * g) * g, as torch orders it: g * g first overflows fp32 for |g| above
    // ~1.8e19, and v = inf then stopped the step
    auto vv = O::fma(O::load(v + i), O::set1(c.beta2),
                     O::mul(O::mul(gv, O::set1(c.one_minus_beta2)), gv));
    const auto denom = O::fma(O::sqrt(vv), O::set1(c.bc2_rsqrt), O::set1(c.eps));
    pv = O::mul(pv, O::set1(c.decay_factor));
    pv = O::sub(pv, O::div(O::mul(mv, O::set1(c.step_size)), denom));
    O::store(m + i, mv);
    O::store(v + i, vv);
    O::store(p + i, pv);
  });
}

}  // namespace

bool adam_update(const AdamParams& hp, DType p_t, void* p, DType g_t, const void* g, DType s_t,
                 void* exp_avg, void* exp_avg_sq, int64_t n) {
  const AdamCoeffs c = coeffs(hp);
  return dispatch_param_grad_state(p_t, g_t, s_t, [&](auto pt, auto gt, auto st) {
    using P = typename decltype(pt)::type;
    using G = typename decltype(gt)::type;
    using S = typename decltype(st)::type;
    update(c, static_cast<P*>(p), static_cast<const G*>(g), static_cast<S*>(exp_avg),
           static_cast<S*>(exp_avg_sq), n);
  });
}

}  // namespace ds
