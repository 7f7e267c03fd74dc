#include "cpu_lion/cpu_lion.h"

#include "simd.h"

namespace ds {

bool lion_update(const LionParams& hp, DType p_t, void* p, DType g_t, const void* g, DType s_t,
                 void* exp_avg, int64_t n) {
  const float lr = float(hp.lr), b1 = float(hp.beta1), b2 = float(hp.beta2);
  const float decay = float(1.0 - hp.lr * hp.weight_decay);
  return dispatch_param_grad_state(p_t, g_t, s_t, [&](auto pt, auto gt, auto st) {
    using P = typename decltype(pt)::type;
    using G = typename decltype(gt)::type;
    using S = typename decltype(st)::type;
    P* pp = static_cast<P*>(p);
    const G* gp = static_cast<const G*>(g);
    S* mp = static_cast<S*>(exp_avg);
    for_each_lane(n, [&](auto ops, int64_t i) {
      using O = decltype(ops);
      const auto gv = O::load(gp + i);
      const auto mv = O::load(mp + i);
      // The update direction interpolates with beta1; the stored momentum with beta2.
      const auto c = O::fma(mv, O::set1(b1), O::mul(gv, O::set1(1.f - b1)));
      auto pv = O::mul(O::load(pp + i), O::set1(decay));
      pv = O::sub(pv, O::mul(O::sign(c), O::set1(lr)));
      O::store(mp + i, O::fma(mv, O::set1(b2), O::mul(gv, O::set1(1.f - b2))));
      O::store(pp + i, pv);
    });
  });
}

}  // namespace ds
