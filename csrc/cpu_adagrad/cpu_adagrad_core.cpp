#include "cpu_adagrad/cpu_adagrad.h"

#include "simd.h"

namespace ds {

bool adagrad_update(const AdagradParams& hp, DType p_t, void* p, DType g_t, const void* g,
                    DType s_t, void* exp_avg_sq, int64_t n) {
  const float lr = float(hp.lr), eps = float(hp.eps), wd = float(hp.weight_decay);
  return dispatch_param_grad_state(p_t, g_t, s_t, [&](auto pt, auto gt, auto st) {
    using P = typename decltype(pt)::type;
    using G = typename decltype(gt)::type;
    using S = typename decltype(st)::type;
    P* pp = static_cast<P*>(p);
    const G* gp = static_cast<const G*>(g);
    S* vp = static_cast<S*>(exp_avg_sq);
    for_each_lane(n, [&](auto ops, int64_t i) {
      using O = decltype(ops);
      auto pv = O::load(pp + i);
      auto gv = O::load(gp + i);
      if (wd != 0.f) gv = O::fma(pv, O::set1(wd), gv);
      const auto vv = O::fma(gv, gv, O::load(vp + i));
      const auto denom = O::add(O::sqrt(vv), O::set1(eps));
      pv = O::sub(pv, O::div(O::mul(gv, O::set1(lr)), denom));
      O::store(vp + i, vv);
      O::store(pp + i, pv);
    });
  });
}

}  // namespace ds
