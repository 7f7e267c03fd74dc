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

#include "transformer/transformer.h"

namespace {

using ds::DType;

DType dtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  if (t.scalar_type() == at::kHalf) return DType::kFloat16;
  return DType::kFloat32;
}

// A contiguous CPU tensor of float32/bfloat16/float16 (or exactly `like`'s dtype).
void check(const char* op, const at::Tensor& t, const char* name, const at::Tensor* like) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " is on ", t.device(),
              "; this op runs on CPU tensors");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  const auto st = t.scalar_type();
  if (like != nullptr) {
    TORCH_CHECK(st == like->scalar_type(), op, ": ", name, " has dtype ", st, " but the input has ",
                like->scalar_type(), "; they must match");
  } else {
    TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op, ": ", name,
                " has dtype ", st, "; expected float32, bfloat16 or float16");
  }
}

int64_t width(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": the input needs a last dimension > 0, got ",
              x.sizes());
  return x.size(-1);
}

void check_vector(const char* op, const at::Tensor& v, const char* name, const at::Tensor& x,
                  int64_t n) {
  check(op, v, name, &x);
  TORCH_CHECK(v.dim() == 1 && v.size(0) == n, op, ": ", name, " has shape ", v.sizes(),
              "; expected [", n, "] (the input's last dimension)");
}

void check_same(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x) {
  check(op, t, name, &x);
  TORCH_CHECK(t.sizes() == x.sizes(), op, ": ", name, " has shape ", t.sizes(),
              " but the input has ", x.sizes());
}

void check_dropout(const char* op, double p, int64_t seed, int64_t offset) {
  TORCH_CHECK(p >= 0 && p <= 1, op, ": dropout p must be in [0, 1], got ", p);
  TORCH_CHECK(seed >= 0 && offset >= 0, op, ": seed and offset must be >= 0, got ", seed, ", ",
              offset);
}

constexpr int64_t kRowGrain = 8;
constexpr int64_t kElemGrain = 1 << 15;
constexpr int64_t kReduceBlocks = 32;  // fixed, so sums do not depend on the thread count

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x,
                                                              const at::Tensor& gamma,
                                                              const at::Tensor& beta, double eps) {
  constexpr const char* op = "transformer.layer_norm_fwd";
  check(op, x, "x", nullptr);
  const int64_t h = width(op, x);
  check_vector(op, gamma, "gamma", x, h);
  check_vector(op, beta, "beta", x, h);
  TORCH_CHECK(eps > 0 && eps < 1, op, ": eps must be in (0, 1), got ", eps);
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
  check(op, src, "src", nullptr);
  const int64_t h = width(op, src);
  const int64_t rows = src.numel() / h;
  check_same(op, dy, "dy", src);
  check_vector(op, gamma, "gamma", src, h);
  check_vector(op, beta, "beta", src, h);
  for (const auto* t : {&mean, &rstd}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == rows,
                op, ": mean and rstd must be contiguous float32 CPU tensors of ", rows,
                " elements (one per row), got ", t->sizes(), " ", t->scalar_type());
  }
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
  check(op, x, "x", nullptr);
  const int64_t n = width(op, x);
  check_vector(op, bias, "bias", x, n);
  at::Tensor y = at::empty_like(x);
  at::parallel_for(0, x.numel() / n, kRowGrain, [&](int64_t r0, int64_t r1) {
    ds::bias_gelu_fwd(dtype_of(x), x.const_data_ptr(), bias.const_data_ptr(), y.data_ptr(), r0, r1,
                      n);
  });
  return y;
}

at::Tensor bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& bias) {
  constexpr const char* op = "transformer.bias_gelu_bwd";
  check(op, x, "x", nullptr);
  const int64_t n = width(op, x);
  check_same(op, dy, "dy", x);
  check_vector(op, bias, "bias", x, n);
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
  check(op, x, "x", nullptr);
  const int64_t n = width(op, x);
  check_vector(op, bias, "bias", x, n);
  check_same(op, residual, "residual", x);
  check_dropout(op, p, seed, offset);
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
  check(op, x, "x", nullptr);
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
  check(op, scores, "scores", nullptr);
  TORCH_CHECK(scores.dim() == 4, op, ": scores must be [batch, heads, queries, keys], got ",
              scores.sizes());
  const int64_t b = scores.size(0), sq = scores.size(2), sk = scores.size(3);
  TORCH_CHECK(sk > 0, op, ": scores have no keys");
  ds::SoftmaxShape s{sk, sq, scores.size(1) * sq, 1};
  const float* m = nullptr;
  if (mask.has_value()) {
    const at::Tensor& mk = *mask;
    TORCH_CHECK(mk.device().is_cpu() && mk.scalar_type() == at::kFloat && mk.is_contiguous(), op,
                ": mask must be a contiguous float32 CPU tensor, got ", mk.scalar_type(), " on ",
                mk.device());
    TORCH_CHECK(mk.dim() == 3 && mk.size(0) == b && (mk.size(1) == 1 || mk.size(1) == sq) &&
                    mk.size(2) == sk,
                op, ": mask has shape ", mk.sizes(), "; expected [", b, ", 1 or ", sq, ", ", sk,
                "] for scores ", scores.sizes());
    s.mq = mk.size(1);
    m = mk.const_data_ptr<float>();
  }
  at::Tensor probs = at::empty_like(scores);
  at::parallel_for(0, scores.numel() / sk, kRowGrain, [&](int64_t r0, int64_t r1) {
    ds::softmax_fwd(dtype_of(scores), scores.const_data_ptr(), m, probs.data_ptr(),
                    static_cast<float>(scale), s, r0, r1);
  });
  return probs;
}

at::Tensor softmax_bwd(const at::Tensor& dprobs, const at::Tensor& probs, double scale) {
  constexpr const char* op = "transformer.softmax_bwd";
  check(op, probs, "probs", nullptr);
  check_same(op, dprobs, "dprobs", probs);
  const int64_t sk = width(op, probs);
  at::Tensor ds_ = at::empty_like(probs);
  at::parallel_for(0, probs.numel() / sk, kRowGrain, [&](int64_t r0, int64_t r1) {
    ds::softmax_bwd(dtype_of(probs), dprobs.const_data_ptr(), probs.const_data_ptr(),
                    ds_.data_ptr(), static_cast<float>(scale), sk, r0, r1);
  });
  return ds_;
}

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
}
