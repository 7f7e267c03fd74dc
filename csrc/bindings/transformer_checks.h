// Input checks shared by the transformer op's CPU and CUDA bindings. Bindings only: this
// header sees at::Tensor; the kernels never do.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "transformer/transformer.h"

namespace ds_bind_tf {

using ds::DType;

inline DType dtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  if (t.scalar_type() == at::kHalf) return DType::kFloat16;
  return DType::kFloat32;
}

// A contiguous tensor on `dev` of float32/bfloat16/float16, or of exactly `like`'s dtype and
// on its device.
inline void check(const char* op, const at::Tensor& t, const char* name, const at::Tensor* like,
                  at::DeviceType dev) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().type() == dev, op, ": ", name, " is on ", t.device(), "; this op runs on ",
              c10::DeviceTypeName(dev), " tensors");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  const auto st = t.scalar_type();
  if (like != nullptr) {
    TORCH_CHECK(t.device() == like->device(), op, ": ", name, " is on ", t.device(),
                " but the input is on ", like->device());
    TORCH_CHECK(st == like->scalar_type(), op, ": ", name, " has dtype ", st, " but the input has ",
                like->scalar_type(), "; they must match");
  } else {
    TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op, ": ", name,
                " has dtype ", st, "; expected float32, bfloat16 or float16");
  }
}

inline int64_t width(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": the input needs a last dimension > 0, got ",
              x.sizes());
  return x.size(-1);
}

inline void check_vector(const char* op, const at::Tensor& v, const char* name, const at::Tensor& x,
                         int64_t n) {
  check(op, v, name, &x, x.device().type());
  TORCH_CHECK(v.dim() == 1 && v.size(0) == n, op, ": ", name, " has shape ", v.sizes(),
              "; expected [", n, "] (the input's last dimension)");
}

inline void check_same(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x) {
  check(op, t, name, &x, x.device().type());
  TORCH_CHECK(t.sizes() == x.sizes(), op, ": ", name, " has shape ", t.sizes(),
              " but the input has ", x.sizes());
}

inline void check_dropout(const char* op, double p, int64_t seed, int64_t offset) {
  TORCH_CHECK(p >= 0 && p <= 1, op, ": dropout p must be in [0, 1], got ", p);
  TORCH_CHECK(seed >= 0 && offset >= 0, op, ": seed and offset must be >= 0, got ", seed, ", ",
              offset);
}

// LayerNorm's saved statistics: contiguous float32, one per row, beside `src`.
inline void check_stats(const char* op, const at::Tensor& mean, const at::Tensor& rstd,
                        const at::Tensor& src, int64_t rows) {
  for (const auto* t : {&mean, &rstd}) {
    TORCH_CHECK(t->device() == src.device() && t->scalar_type() == at::kFloat &&
                    t->is_contiguous() && t->numel() == rows,
                op, ": mean and rstd must be contiguous float32 tensors of ", rows,
                " elements (one per row) on ", src.device(), ", got ", t->sizes(), " ",
                t->scalar_type(), " on ", t->device());
  }
}

// Each op's whole input check, shared by the CPU and CUDA bindings; each returns the widths
// (and row counts) the kernels need.

// layer_norm_fwd: the row width h.
inline int64_t check_ln_fwd(const char* op, const at::Tensor& x, const at::Tensor& gamma,
                            const at::Tensor& beta, double eps, at::DeviceType dev) {
  check(op, x, "x", nullptr, dev);
  const int64_t h = width(op, x);
  check_vector(op, gamma, "gamma", x, h);
  check_vector(op, beta, "beta", x, h);
  TORCH_CHECK(eps > 0 && eps < 1, op, ": eps must be in (0, 1), got ", eps);
  return h;
}

// layer_norm_bwd: (rows, h).
inline std::pair<int64_t, int64_t> check_ln_bwd(const char* op, const at::Tensor& dy,
                                                const at::Tensor& src, const at::Tensor& gamma,
                                                const at::Tensor& beta, const at::Tensor& mean,
                                                const at::Tensor& rstd, at::DeviceType dev) {
  check(op, src, "src", nullptr, dev);
  const int64_t h = width(op, src);
  const int64_t rows = src.numel() / h;
  check_same(op, dy, "dy", src);
  check_vector(op, gamma, "gamma", src, h);
  check_vector(op, beta, "beta", src, h);
  check_stats(op, mean, rstd, src, rows);
  return {rows, h};
}

// bias_gelu_fwd (dy undefined) / bias_gelu_bwd: the row width n.
inline int64_t check_bias_gelu(const char* op, const at::Tensor& x, const at::Tensor& bias,
                               const at::Tensor* dy, at::DeviceType dev) {
  check(op, x, "x", nullptr, dev);
  const int64_t n = width(op, x);
  if (dy != nullptr) check_same(op, *dy, "dy", x);
  check_vector(op, bias, "bias", x, n);
  return n;
}

// bias_dropout_residual: the row width n.
inline int64_t check_bias_dropout_residual(const char* op, const at::Tensor& x,
                                           const at::Tensor& bias, const at::Tensor& residual,
                                           double p, int64_t seed, int64_t offset,
                                           at::DeviceType dev) {
  check(op, x, "x", nullptr, dev);
  const int64_t n = width(op, x);
  check_vector(op, bias, "bias", x, n);
  check_same(op, residual, "residual", x);
  check_dropout(op, p, seed, offset);
  return n;
}

// softmax_bwd: the row width sk.
inline int64_t check_softmax_bwd(const char* op, const at::Tensor& dprobs, const at::Tensor& probs,
                                 at::DeviceType dev) {
  check(op, probs, "probs", nullptr, dev);
  check_same(op, dprobs, "dprobs", probs);
  return width(op, probs);
}

// The shape of a softmax over scores [batch, heads, queries, keys] and its optional fp32
// additive mask [batch, 1 or queries, keys] (beside the scores).
inline std::pair<ds::SoftmaxShape, const float*> softmax_shape(
    const char* op, const at::Tensor& scores, const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(scores.dim() == 4, op, ": scores must be [batch, heads, queries, keys], got ",
              scores.sizes());
  const int64_t b = scores.size(0), sq = scores.size(2), sk = scores.size(3);
  TORCH_CHECK(sk > 0, op, ": scores have no keys");
  ds::SoftmaxShape s{sk, sq, scores.size(1) * sq, 1};
  if (!mask.has_value()) return {s, nullptr};
  const at::Tensor& mk = *mask;
  TORCH_CHECK(
      mk.device() == scores.device() && mk.scalar_type() == at::kFloat && mk.is_contiguous(), op,
      ": mask must be a contiguous float32 tensor on ", scores.device(), ", got ", mk.scalar_type(),
      " on ", mk.device());
  TORCH_CHECK(
      mk.dim() == 3 && mk.size(0) == b && (mk.size(1) == 1 || mk.size(1) == sq) && mk.size(2) == sk,
      op, ": mask has shape ", mk.sizes(), "; expected [", b, ", 1 or ", sq, ", ", sk,
      "] for scores ", scores.sizes());
  s.mq = mk.size(1);
  return {s, mk.const_data_ptr<float>()};
}

}  // namespace ds_bind_tf
