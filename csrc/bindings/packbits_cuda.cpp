// torch.ops.ds_packbits_cuda: checks every input, then hands plain pointers to the CUDA core
// ([Note: sign packing] in packbits/packbits.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "packbits/packbits_cuda.h"
#include "packbits_checks.h"

namespace {

at::Tensor sum_squares(const at::Tensor& x, const c10::optional<at::Tensor>& err) {
  constexpr const char* op = "packbits_cuda.sum_squares";
  ds_bind::check_values(x, true, op);
  ds_bind::check_error(err, x, op);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({}, x.options().dtype(at::kDouble));
  C10_CUDA_CHECK(ds::launch_sum_squares(
      ds_bind::value_dtype(x, op), x.data_ptr(), err.has_value() ? err->data_ptr<float>() : nullptr,
      x.numel(), out.data_ptr<double>(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

void pack(const at::Tensor& x, const c10::optional<at::Tensor>& err, const at::Tensor& scale,
          at::Tensor& bits) {
  constexpr const char* op = "packbits_cuda.pack";
  ds_bind::check_values(x, true, op);
  ds_bind::check_error(err, x, op);
  ds_bind::check_scale(scale, x, op);
  ds_bind::check_bits(bits, x, x.numel(), op);
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(ds::launch_pack_signs(ds_bind::value_dtype(x, op), x.data_ptr(),
                                       err.has_value() ? err->data_ptr<float>() : nullptr,
                                       scale.data_ptr<float>(), bits.data_ptr<uint8_t>(), x.numel(),
                                       c10::cuda::getCurrentCUDAStream()));
}

void unpack(const at::Tensor& bits, const at::Tensor& scale, at::Tensor& out, bool accumulate) {
  constexpr const char* op = "packbits_cuda.unpack";
  TORCH_CHECK(bits.is_cuda(), op, ": bits is on ", bits.device(), "; this op runs on CUDA tensors");
  ds_bind::check_out(out, bits, op);
  ds_bind::check_scale(scale, bits, op);
  ds_bind::check_bits(bits, out, out.numel(), op);
  const c10::cuda::CUDAGuard guard(bits.device());
  C10_CUDA_CHECK(ds::launch_unpack_signs(bits.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                         out.data_ptr<float>(), out.numel(), accumulate,
                                         c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY(ds_packbits_cuda, m) {
  m.def("sum_squares(Tensor x, Tensor? err) -> Tensor", &sum_squares);
  m.def("pack(Tensor x, Tensor(a!)? err, Tensor scale, Tensor(b!) bits) -> ()", &pack);
  m.def("unpack(Tensor bits, Tensor scale, Tensor(a!) out, bool accumulate) -> ()", &unpack);
}
