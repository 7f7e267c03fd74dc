// torch.ops.ds_transformer_cuda: the CUDA kernels of the fused transformer layer
// ([Note: transformer kernels]). The same schemas and checks as the CPU op (transformer.cpp,
// transformer_checks.h), on CUDA tensors of one device, on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "transformer/transformer_cuda.h"
#include "transformer_checks.h"
#include "transformer_layer.h"

namespace {

using namespace ds_bind_tf;  // NOLINT: the checks shared with the CPU binding

constexpr at::DeviceType kDev = at::kCUDA;

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x,
                                                              const at::Tensor& gamma,
                                                              const at::Tensor& beta, double eps) {
  constexpr const char* op = "transformer_cuda.layer_norm_fwd";
  const int64_t h = check_ln_fwd(op, x, gamma, beta, eps, kDev);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.numel() / h;
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(ds::layer_norm_fwd_cuda(dtype_of(x), x.const_data_ptr(), gamma.const_data_ptr(),
                                         beta.const_data_ptr(), y.data_ptr(),
                                         mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, h,
                                         static_cast<float>(eps), stream_of(x)));
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& dy, const at::Tensor& src, bool src_is_output, const at::Tensor& gamma,
    const at::Tensor& beta, const at::Tensor& mean, const at::Tensor& rstd) {
  constexpr const char* op = "transformer_cuda.layer_norm_bwd";
  const auto [rows, h] = check_ln_bwd(op, dy, src, gamma, beta, mean, rstd, kDev);
  const c10::cuda::CUDAGuard guard(src.device());
  at::Tensor dx = at::empty_like(src);
  const int64_t parts = ds::layer_norm_bwd_parts(rows);
  at::Tensor partial = at::empty({2, parts, h}, src.options().dtype(at::kFloat));
  C10_CUDA_CHECK(ds::layer_norm_bwd_cuda(
      dtype_of(src), dy.const_data_ptr(), src.const_data_ptr(), src_is_output,
      gamma.const_data_ptr(), beta.const_data_ptr(), mean.const_data_ptr<float>(),
      rstd.const_data_ptr<float>(), dx.data_ptr(), partial.data_ptr<float>(),
      partial.data_ptr<float>() + parts * h, rows, h, stream_of(src)));
  at::Tensor sums = partial.sum(1);  // over the blocks' partial rows
  return {dx, sums[0], sums[1]};
}

at::Tensor bias_gelu_fwd(const at::Tensor& x, const at::Tensor& bias) {
  constexpr const char* op = "transformer_cuda.bias_gelu_fwd";
  const int64_t n = check_bias_gelu(op, x, bias, nullptr, kDev);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  C10_CUDA_CHECK(ds::bias_gelu_fwd_cuda(dtype_of(x), x.const_data_ptr(), bias.const_data_ptr(),
                                        y.data_ptr(), x.numel(), n, stream_of(x)));
  return y;
}

at::Tensor bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& bias) {
  constexpr const char* op = "transformer_cuda.bias_gelu_bwd";
  const int64_t n = check_bias_gelu(op, x, bias, &dy, kDev);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  C10_CUDA_CHECK(ds::bias_gelu_bwd_cuda(dtype_of(x), dy.const_data_ptr(), x.const_data_ptr(),
                                        bias.const_data_ptr(), dx.data_ptr(), x.numel(), n,
                                        stream_of(x)));
  return dx;
}

at::Tensor bias_dropout_residual(const at::Tensor& x, const at::Tensor& bias,
                                 const at::Tensor& residual, double p, int64_t seed,
                                 int64_t offset) {
  constexpr const char* op = "transformer_cuda.bias_dropout_residual";
  const int64_t n = check_bias_dropout_residual(op, x, bias, residual, p, seed, offset, kDev);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  C10_CUDA_CHECK(ds::bias_dropout_residual_cuda(
      dtype_of(x), x.const_data_ptr(), bias.const_data_ptr(), residual.const_data_ptr(),
      out.data_ptr(), static_cast<float>(p), static_cast<uint64_t>(seed),
      static_cast<uint64_t>(offset), x.numel(), n, stream_of(x)));
  return out;
}

at::Tensor dropout(const at::Tensor& x, double p, int64_t seed, int64_t offset) {
  constexpr const char* op = "transformer_cuda.dropout";
  check(op, x, "x", nullptr, kDev);
  check_dropout(op, p, seed, offset);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  C10_CUDA_CHECK(ds::dropout_cuda(dtype_of(x), x.const_data_ptr(), out.data_ptr(),
                                  static_cast<float>(p), static_cast<uint64_t>(seed),
                                  static_cast<uint64_t>(offset), x.numel(), stream_of(x)));
  return out;
}

at::Tensor softmax_fwd(const at::Tensor& scores, const std::optional<at::Tensor>& mask,
                       double scale) {
  constexpr const char* op = "transformer_cuda.softmax_fwd";
  check(op, scores, "scores", nullptr, kDev);
  const auto [s, m] = softmax_shape(op, scores, mask);
  const c10::cuda::CUDAGuard guard(scores.device());
  at::Tensor probs = at::empty_like(scores);
  C10_CUDA_CHECK(ds::softmax_fwd_cuda(dtype_of(scores), scores.const_data_ptr(), m,
                                      probs.data_ptr(), static_cast<float>(scale), s,
                                      scores.numel() / s.sk, stream_of(scores)));
  return probs;
}

at::Tensor softmax_bwd(const at::Tensor& dprobs, const at::Tensor& probs, double scale) {
  constexpr const char* op = "transformer_cuda.softmax_bwd";
  const int64_t sk = check_softmax_bwd(op, dprobs, probs, kDev);
  const c10::cuda::CUDAGuard guard(probs.device());
  at::Tensor ds_ = at::empty_like(probs);
  C10_CUDA_CHECK(ds::softmax_bwd_cuda(
      dtype_of(probs), dprobs.const_data_ptr(), probs.const_data_ptr(), ds_.data_ptr(),
      static_cast<float>(scale), sk, probs.numel() / sk, stream_of(probs)));
  return ds_;
}

DS_DEFINE_LAYER_OPS("transformer_cuda")  // [Note: transformer layer op]

void impl_all(torch::Library& m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
  m.impl("bias_gelu_fwd", &bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd);
  m.impl("bias_dropout_residual", &bias_dropout_residual);
  m.impl("dropout", &dropout);
  m.impl("softmax_fwd", &softmax_fwd);
  m.impl("softmax_bwd", &softmax_bwd);
  m.impl("layer_fwd", &layer_fwd);
  m.impl("layer_bwd", &layer_bwd);
}

}  // namespace

TORCH_LIBRARY(ds_transformer_cuda, m) {
  m.def(
      "layer_norm_fwd(Tensor x, Tensor gamma, Tensor beta, float eps) -> (Tensor, Tensor, "
      "Tensor)");
  m.def(
      "layer_norm_bwd(Tensor dy, Tensor src, bool src_is_output, Tensor gamma, Tensor beta, "
      "Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)");
  m.def("bias_gelu_fwd(Tensor x, Tensor bias) -> Tensor");
  m.def("bias_gelu_bwd(Tensor dy, Tensor x, Tensor bias) -> Tensor");
  m.def(
      "bias_dropout_residual(Tensor x, Tensor bias, Tensor residual, float p, int seed, "
      "int offset) -> Tensor");
  m.def("dropout(Tensor x, float p, int seed, int offset) -> Tensor");
  m.def("softmax_fwd(Tensor scores, Tensor? mask, float scale) -> Tensor");
  m.def("softmax_bwd(Tensor dprobs, Tensor probs, float scale) -> Tensor");
  m.def(LAYER_FWD_SCHEMA);
  m.def(LAYER_BWD_SCHEMA);
}

TORCH_LIBRARY_IMPL(ds_transformer_cuda, CUDA, m) { impl_all(m); }

// The same functions on CPU tensors: each one's input check rejects them first, naming the
// tensor and its device, instead of the dispatcher's list of backends.
TORCH_LIBRARY_IMPL(ds_transformer_cuda, CPU, m) { impl_all(m); }
