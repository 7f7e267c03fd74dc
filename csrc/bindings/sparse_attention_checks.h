// Input checks shared by the block-sparse attention op's CPU and CUDA bindings. Bindings only:
// this header sees at::Tensor; the kernels never do.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "sparse_attention/sparse_attention.h"

namespace ds_bind_sa {

using ds::DenseView;
using ds::DType;

inline DType dtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  if (t.scalar_type() == at::kHalf) return DType::kFloat16;
  return DType::kFloat32;
}

inline void check_float(const char* op, const at::Tensor& t, const char* name, at::DeviceType dev) {
  TORCH_CHECK(t.defined() && t.device().type() == dev, op, ": ", name, " must be a ",
              c10::DeviceTypeName(dev), " tensor");
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op, ": ", name,
              " has dtype ", st, "; expected float32, bfloat16 or float16");
}

// A dense [batch, heads, rows, cols] operand read as [rows, cols] (trans: [cols, rows]), of
// `like`'s dtype and device.
inline DenseView view_of(const char* op, const at::Tensor& t, const char* name, bool trans,
                         int64_t heads, int64_t batch, const at::Tensor& like) {
  check_float(op, t, name, like.device().type());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(),
              " but the other operand is on ", like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but the other operand has ", like.scalar_type());
  TORCH_CHECK(t.dim() == 4 && t.size(0) == batch && t.size(1) == heads, op, ": ", name,
              " has shape ", t.sizes(), "; expected [", batch, ", ", heads, ", rows, cols]");
  return DenseView{t.const_data_ptr(), t.stride(0), t.stride(1), trans ? t.stride(3) : t.stride(2),
                   trans ? t.stride(2) : t.stride(3)};
}

inline int64_t rows(const at::Tensor& t, bool trans) { return t.size(trans ? 3 : 2); }
inline int64_t cols(const at::Tensor& t, bool trans) { return t.size(trans ? 2 : 3); }

inline void check_sparse(const char* op, const at::Tensor& s, const char* name, int64_t nnz,
                         int64_t block, at::DeviceType dev) {
  check_float(op, s, name, dev);
  TORCH_CHECK(s.is_contiguous() && s.dim() == 4 && s.size(1) == nnz && s.size(2) == block &&
                  s.size(3) == block,
              op, ": ", name, " has shape ", s.sizes(), "; expected a contiguous [batch, ", nnz,
              ", ", block, ", ", block, "] block-sparse tensor of this layout");
}

// An fp32 additive softmax term with a contiguous last dimension, on `like`'s device.
inline const float* term(const char* op, const std::optional<at::Tensor>& t, const char* name,
                         int64_t dims, const at::Tensor& like) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device() == like.device() && t->scalar_type() == at::kFloat && t->dim() == dims &&
                  t->stride(dims - 1) == 1,
              op, ": ", name, " must be a float32 tensor on ", like.device(), " of ", dims,
              " dimensions with a contiguous last one, got ", t->sizes(), " ", t->scalar_type(),
              " on ", t->device());
  return t->const_data_ptr<float>();
}

// The softmax's additive terms, checked against the layout's shape.
inline ds::SoftmaxTerms softmax_terms(const char* op, const at::Tensor& x, int64_t heads,
                                      int64_t side, const std::optional<at::Tensor>& rpe,
                                      const std::optional<at::Tensor>& kp,
                                      const std::optional<at::Tensor>& attn) {
  const int64_t batch = x.size(0);
  ds::SoftmaxTerms t{};
  t.rpe = term(op, rpe, "rpe", 4, x);
  if (t.rpe != nullptr) {
    TORCH_CHECK((rpe->size(0) == batch || rpe->stride(0) == 0) && rpe->size(1) == heads &&
                    rpe->size(2) == side && rpe->size(3) == side,
                op, ": rpe has shape ", rpe->sizes(), "; expected [", batch, ", ", heads, ", ",
                side, ", ", side, "]");
    t.rpe_sb = rpe->stride(0);
    t.rpe_sh = rpe->stride(1);
    t.rpe_si = rpe->stride(2);
  }
  t.kp = term(op, kp, "key_padding_mask", 2, x);
  if (t.kp != nullptr) {
    TORCH_CHECK(kp->size(0) == batch && kp->size(1) == side, op, ": key_padding_mask has shape ",
                kp->sizes(), "; expected [", batch, ", ", side, "]");
    t.kp_sb = kp->stride(0);
  }
  t.attn = term(op, attn, "attn_mask", 2, x);
  if (t.attn != nullptr) {
    TORCH_CHECK(attn->size(0) == side && attn->size(1) == side, op, ": attn_mask has shape ",
                attn->sizes(), "; expected [", side, ", ", side, "]");
    t.attn_si = attn->stride(0);
  }
  return t;
}

// The products' schemas, the same in the CPU and the CUDA library (their softmaxes differ:
// the CUDA one takes the head count).
inline void def_products(torch::Library& m) {
  m.def(
      "sdd(Tensor a, bool trans_a, Tensor b, bool trans_b, Tensor lut, int nnz, int block) -> "
      "Tensor");
  m.def("dsd(Tensor a, bool trans_a, Tensor b, bool trans_b, Tensor lut) -> Tensor");
  m.def("dds(Tensor a, bool trans_a, Tensor b, bool trans_b, Tensor lut) -> Tensor");
}

}  // namespace ds_bind_sa
