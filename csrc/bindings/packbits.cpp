// torch binding of the CPU sign-packing kernels: checks every input, then runs the core in
// parallel over byte-aligned pieces.
#include <ATen/Parallel.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <utility>

#include "packbits/packbits.h"
#include "packbits_checks.h"
#include "simd.h"

namespace {

constexpr int64_t kGrainBytes = 1 << 13;  // 64K elements per task

at::Tensor sum_squares(const at::Tensor& x, const c10::optional<at::Tensor>& err) {
  constexpr const char* op = "packbits.sum_squares";
  ds_bind::check_values(x, false, op);
  ds_bind::check_error(err, x, op);
  const ds::DType t = ds_bind::value_dtype(x, op);
  const size_t esize = ds::dtype_size(t);
  const auto* xp = static_cast<const char*>(x.data_ptr());
  const float* ep = err.has_value() ? err->data_ptr<float>() : nullptr;
  const int64_t n = x.numel();
  const double total = at::parallel_reduce(
      0, n, 8 * kGrainBytes, 0.0,
      [&](int64_t b, int64_t e, double acc) {
        return acc + ds::sum_squares(t, xp + b * esize, ep ? ep + b : nullptr, e - b);
      },
      [](double a, double b) { return a + b; });
  return at::scalar_tensor(total, at::kDouble);
}

void pack(const at::Tensor& x, const c10::optional<at::Tensor>& err, const at::Tensor& scale_t,
          at::Tensor& bits) {
  constexpr const char* op = "packbits.pack";
  ds_bind::check_values(x, false, op);
  ds_bind::check_error(err, x, op);
  ds_bind::check_scale(scale_t, x, op);
  const float scale = scale_t.item<float>();
  ds_bind::check_scale_value(scale, op);
  const int64_t n = x.numel();
  ds_bind::check_bits(bits, x, n, op);
  const ds::DType t = ds_bind::value_dtype(x, op);
  const size_t esize = ds::dtype_size(t);
  const auto* xp = static_cast<const char*>(x.data_ptr());
  float* ep = err.has_value() ? err->data_ptr<float>() : nullptr;
  uint8_t* bp = bits.data_ptr<uint8_t>();
  at::parallel_for(0, ds_bind::packed_bytes(n), kGrainBytes, [&](int64_t b0, int64_t b1) {
    const int64_t i0 = 8 * b0, i1 = std::min(8 * b1, n);
    ds::pack_signs(t, xp + i0 * esize, ep ? ep + i0 : nullptr, scale, bp + b0, i1 - i0);
  });
}

void unpack(const at::Tensor& bits, const at::Tensor& scale_t, at::Tensor& out, bool accumulate) {
  constexpr const char* op = "packbits.unpack";
  TORCH_CHECK(bits.device().is_cpu(), op, ": bits is on ", bits.device(),
              "; this op runs on CPU tensors");
  ds_bind::check_scale(scale_t, bits, op);
  const float scale = scale_t.item<float>();
  ds_bind::check_scale_value(scale, op);
  ds_bind::check_out(out, bits, op);
  const int64_t n = out.numel();
  ds_bind::check_bits(bits, out, n, op);
  const uint8_t* bp = bits.data_ptr<uint8_t>();
  float* op_ = out.data_ptr<float>();
  at::parallel_for(0, ds_bind::packed_bytes(n), kGrainBytes, [&](int64_t b0, int64_t b1) {
    const int64_t i0 = 8 * b0, i1 = std::min(8 * b1, n);
    ds::unpack_signs(bp + b0, scale, op_ + i0, i1 - i0, accumulate);
  });
}

std::tuple<double, int64_t> abs_sum_above(const at::Tensor& x, const c10::optional<at::Tensor>& err,
                                          double cut) {
  constexpr const char* op = "packbits.abs_sum_above";
  ds_bind::check_values(x, false, op);
  ds_bind::check_error(err, x, op);
  const ds::DType t = ds_bind::value_dtype(x, op);
  const size_t esize = ds::dtype_size(t);
  const auto* xp = static_cast<const char*>(x.data_ptr());
  const float* ep = err.has_value() ? err->data_ptr<float>() : nullptr;
  using Acc = std::pair<double, int64_t>;
  const Acc total = at::parallel_reduce(
      0, x.numel(), 8 * kGrainBytes, Acc{0.0, 0},
      [&](int64_t b, int64_t e, Acc acc) {
        double s = 0.0;
        int64_t c = 0;
        ds::abs_sum_above(t, xp + b * esize, ep ? ep + b : nullptr, e - b, float(cut), &s, &c);
        return Acc{acc.first + s, acc.second + c};
      },
      [](Acc a, Acc b) { return Acc{a.first + b.first, a.second + b.second}; });
  return {total.first, total.second};
}

void check_levels(double lo, double hi, const char* op) {
  TORCH_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo >= 0 && hi >= 0, op, ": levels lo=", lo,
              ", hi=", hi, "; expected finite values >= 0");
}

void pack2(const at::Tensor& x, const c10::optional<at::Tensor>& err, double cut, double lo,
           double hi, at::Tensor& signs, at::Tensor& levels) {
  constexpr const char* op = "packbits.pack2";
  ds_bind::check_values(x, false, op);
  ds_bind::check_error(err, x, op);
  check_levels(lo, hi, op);
  const int64_t n = x.numel();
  ds_bind::check_bits(signs, x, n, op);
  ds_bind::check_bits(levels, x, n, op);
  const ds::DType t = ds_bind::value_dtype(x, op);
  const size_t esize = ds::dtype_size(t);
  const auto* xp = static_cast<const char*>(x.data_ptr());
  float* ep = err.has_value() ? err->data_ptr<float>() : nullptr;
  uint8_t* sp = signs.data_ptr<uint8_t>();
  uint8_t* lp = levels.data_ptr<uint8_t>();
  at::parallel_for(0, ds_bind::packed_bytes(n), kGrainBytes, [&](int64_t b0, int64_t b1) {
    const int64_t i0 = 8 * b0, i1 = std::min(8 * b1, n);
    ds::pack_two_bits(t, xp + i0 * esize, ep ? ep + i0 : nullptr, float(cut), float(lo), float(hi),
                      sp + b0, lp + b0, i1 - i0);
  });
}

void unpack2(const at::Tensor& signs, const at::Tensor& levels, double lo, double hi,
             at::Tensor& out, bool accumulate) {
  constexpr const char* op = "packbits.unpack2";
  TORCH_CHECK(signs.device().is_cpu(), op, ": signs is on ", signs.device(),
              "; this op runs on CPU tensors");
  check_levels(std::fabs(lo), std::fabs(hi), op);  // a negative weight flips both
  ds_bind::check_out(out, signs, op);
  const int64_t n = out.numel();
  ds_bind::check_bits(signs, out, n, op);
  ds_bind::check_bits(levels, out, n, op);
  const uint8_t* sp = signs.data_ptr<uint8_t>();
  const uint8_t* lp = levels.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, ds_bind::packed_bytes(n), kGrainBytes, [&](int64_t b0, int64_t b1) {
    const int64_t i0 = 8 * b0, i1 = std::min(8 * b1, n);
    ds::unpack_two_bits(sp + b0, lp + b0, float(lo), float(hi), o + i0, i1 - i0, accumulate);
  });
}

std::string simd_level() { return ds::kSimdName; }

}  // namespace

TORCH_LIBRARY(ds_packbits, m) {
  m.def("sum_squares(Tensor x, Tensor? err) -> Tensor", &sum_squares);
  m.def("pack(Tensor x, Tensor(a!)? err, Tensor scale, Tensor(b!) bits) -> ()", &pack);
  m.def("unpack(Tensor bits, Tensor scale, Tensor(a!) out, bool accumulate) -> ()", &unpack);
  m.def("abs_sum_above(Tensor x, Tensor? err, float cut) -> (float, int)", &abs_sum_above);
  m.def(
      "pack2(Tensor x, Tensor(a!)? err, float cut, float lo, float hi, Tensor(b!) signs, "
      "Tensor(c!) levels) -> ()",
      &pack2);
  m.def(
      "unpack2(Tensor signs, Tensor levels, float lo, float hi, Tensor(a!) out, bool "
      "accumulate) -> ()",
      &unpack2);
  m.def("simd_level() -> str", &simd_level);
}
