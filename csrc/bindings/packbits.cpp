// torch binding of the CPU sign-packing kernels: checks every input, then runs the core in
// parallel over byte-aligned pieces.
#include <ATen/Parallel.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

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

void unpack(const at::Tensor& bits, const at::Tensor& scale_t, at::Tensor& out,
            bool accumulate) {
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

std::string simd_level() { return ds::kSimdName; }

}  // namespace

TORCH_LIBRARY(ds_packbits, m) {
  m.def("sum_squares(Tensor x, Tensor? err) -> Tensor", &sum_squares);
  m.def("pack(Tensor x, Tensor(a!)? err, Tensor scale, Tensor(b!) bits) -> ()", &pack);
  m.def("unpack(Tensor bits, Tensor scale, Tensor(a!) out, bool accumulate) -> ()", &unpack);
  m.def("simd_level() -> str", &simd_level);
}
