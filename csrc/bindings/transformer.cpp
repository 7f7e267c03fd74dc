// torch.ops.ds_transformer: the CPU kernels of the fused transformer layer
// ([Note: transformer kernels]). Checks every input, then splits rows across threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "transformer/transformer.h"
#include "transformer_checks.h"
#include "transformer_layer.h"

namespace {

using namespace ds_bind_tf;  // NOLINT: the checks shared with the CUDA binding

constexpr at::DeviceType kDev = at::kCPU;

constexpr int64_t kRowGrain = 8;
constexpr int64_t kElemGrain = 1 << 15;
constexpr int64_t kReduceBlocks = 32;  // fixed, so sums do not depend on the thread count

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x,
                                                              const at::Tensor& gamma,
                                                              const at::Tensor& beta, double eps) {
  constexpr const char* op = "transformer.layer_norm_fwd";
  const int64_t h = check_ln_fwd(op, x, gamma, beta, eps, kDev);
  const int64_t rows = x.numel() / h;
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    ds::layer_norm_fwd(dtype_of(x), x.const_data_ptr(), gamma.const_data_ptr(),
                       beta.const_data_ptr(), y.data_ptr(), mean.data_ptr<float>(),
                       rstd.data_ptr<float>(), r0, r1, h, static_cast<float>(eps));
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& dy, const at::Tensor& src, bool src_is_output, const at::Tensor& gamma,
    const at::Tensor& beta, const at::Tensor& mean, const at::Tensor& rstd) {
  constexpr const char* op = "transformer.layer_norm_bwd";
  const auto [rows, h] = check_ln_bwd(op, dy, src, gamma, beta, mean, rstd, kDev);
  at::Tensor dx = at::empty_like(src);
  const int64_t blocks = std::max<int64_t>(1, std::min(rows, kReduceBlocks));
  at::Tensor partial = at::zeros({blocks, 2, h}, src.options().dtype(at::kFloat));
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* acc = partial.data_ptr<float>() + b * 2 * h;
      ds::layer_norm_bwd(dtype_of(src), dy.const_data_ptr(), src.const_data_ptr(), src_is_output,
                         gamma.const_data_ptr(), beta.const_data_ptr(),
                         mean.const_data_ptr<float>(), rstd.const_data_ptr<float>(), dx.data_ptr(),
                         acc, acc + h, rows * b / blocks, rows * (b + 1) / blocks, h);
    }
  });
  at::Tensor sums = partial.sum(0);
  return {dx, sums[0], sums[1]};
}

at::Tensor bias_gelu_fwd(const at::Tensor& x, const at::Tensor& bias) {
  constexpr const char* op = "transformer.bias_gelu_fwd";
  const int64_t n = check_bias_gelu(op, x, bias, nullptr, kDev);
  at::Tensor y = at::empty_like(x);
  at::parallel_for(0, x.numel() / n, kRowGrain, [&](int64_t r0, int64_t r1) {
    ds::bias_gelu_fwd(dtype_of(x), x.const_data_ptr(), bias.const_data_ptr(), y.data_ptr(), r0, r1,
                      n);
  });
  return y;
}

at::Tensor bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& bias) {
  constexpr const char* op = "transformer.bias_gelu_bwd";
  const int64_t n = check_bias_gelu(op, x, bias, &dy, kDev);
  at::Tensor dx = at::empty_like(x);
  at::parallel_for(0, x.numel() / n, kRowGrain, [&](int64_t r0, int64_t r1) {
    ds::bias_gelu_bwd(dtype_of(x), dy.const_data_ptr(), x.const_data_ptr(), bias.const_data_ptr(),
                      dx.data_ptr(), r0, r1, n);
  });
  return dx;
}

at::Tensor bias_dropout_residual(const at::Tensor& x, const at::Tensor& bias,
                                 const at::Tensor& residual, double p, int64_t seed,
                                 int64_t offset) {
  constexpr const char* op = "transformer.bias_dropout_residual";
  const int64_t n = check_bias_dropout_residual(op, x, bias, residual, p, seed, offset, kDev);
  at::Tensor out = at::empty_like(x);
  at::parallel_for(0, x.numel() / n, kRowGrain, [&](int64_t r0, int64_t r1) {
    ds::bias_dropout_residual_fwd(dtype_of(x), x.const_data_ptr(), bias.const_data_ptr(),
                                  residual.const_data_ptr(), out.data_ptr(), static_cast<float>(p),
                                  static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), r0,
                                  r1, n);
  });
  return out;
}

at::Tensor dropout(const at::Tensor& x, double p, int64_t seed, int64_t offset) {
  constexpr const char* op = "transformer.dropout";
  check(op, x, "x", nullptr, kDev);
  check_dropout(op, p, seed, offset);
  at::Tensor out = at::empty_like(x);
  at::parallel_for(0, x.numel(), kElemGrain, [&](int64_t e0, int64_t e1) {
    ds::dropout_apply(dtype_of(x), x.const_data_ptr(), out.data_ptr(), static_cast<float>(p),
                      static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), e0, e1);
  });
  return out;
}

at::Tensor softmax_fwd(const at::Tensor& scores, const std::optional<at::Tensor>& mask,
                       double scale) {
  constexpr const char* op = "transformer.softmax_fwd";
  check(op, scores, "scores", nullptr, kDev);
  const auto [s, m] = softmax_shape(op, scores, mask);
  const int64_t sk = s.sk;
  at::Tensor probs = at::empty_like(scores);
  at::parallel_for(0, scores.numel() / sk, kRowGrain, [&](int64_t r0, int64_t r1) {
    ds::softmax_fwd(dtype_of(scores), scores.const_data_ptr(), m, probs.data_ptr(),
                    static_cast<float>(scale), s, r0, r1);
  });
  return probs;
}

at::Tensor softmax_bwd(const at::Tensor& dprobs, const at::Tensor& probs, double scale) {
  constexpr const char* op = "transformer.softmax_bwd";
  const int64_t sk = check_softmax_bwd(op, dprobs, probs, kDev);
  at::Tensor ds_ = at::empty_like(probs);
  at::parallel_for(0, probs.numel() / sk, kRowGrain, [&](int64_t r0, int64_t r1) {
    ds::softmax_bwd(dtype_of(probs), dprobs.const_data_ptr(), probs.const_data_ptr(),
                    ds_.data_ptr(), static_cast<float>(scale), sk, r0, r1);
  });
  return ds_;
}

DS_DEFINE_LAYER_OPS("transformer")  // [Note: transformer layer op]

}  // namespace

TORCH_LIBRARY(ds_transformer, m) {
  m.def(
      "layer_norm_fwd(Tensor x, Tensor gamma, Tensor beta, float eps) -> (Tensor, Tensor, Tensor)",
      &layer_norm_fwd);
  m.def(
      "layer_norm_bwd(Tensor dy, Tensor src, bool src_is_output, Tensor gamma, Tensor beta, "
      "Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)",
      &layer_norm_bwd);
  m.def("bias_gelu_fwd(Tensor x, Tensor bias) -> Tensor", &bias_gelu_fwd);
  m.def("bias_gelu_bwd(Tensor dy, Tensor x, Tensor bias) -> Tensor", &bias_gelu_bwd);
  m.def(
      "bias_dropout_residual(Tensor x, Tensor bias, Tensor residual, float p, int seed, "
      "int offset) -> Tensor",
      &bias_dropout_residual);
  m.def("dropout(Tensor x, float p, int seed, int offset) -> Tensor", &dropout);
  m.def("softmax_fwd(Tensor scores, Tensor? mask, float scale) -> Tensor", &softmax_fwd);
  m.def("softmax_bwd(Tensor dprobs, Tensor probs, float scale) -> Tensor", &softmax_bwd);
  m.def(LAYER_FWD_SCHEMA, &layer_fwd);
  m.def(LAYER_BWD_SCHEMA, &layer_bwd);
}
