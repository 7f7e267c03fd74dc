// torch.ops.ds_sparse_attention: block-sparse matmuls and softmax on the CPU
// ([Note: block-sparse kernels]). Checks every input (the look-up table too: a bad one would
// read out of bounds), then splits the work items across threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "sparse_attention/sparse_attention.h"

namespace {

using ds::BlockLut;
using ds::DenseView;
using ds::DType;

DType dtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  if (t.scalar_type() == at::kHalf) return DType::kFloat16;
  return DType::kFloat32;
}

void check_float(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined() && t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op, ": ", name,
              " has dtype ", st, "; expected float32, bfloat16 or float16");
}

// The look-up table, one int32 tensor: [nnz, heads, nb, block, blocks (3 nnz), row_ptr
// (heads nb + 1), row_idx (nnz), col_ptr (heads nb + 1), col_idx (nnz)].
BlockLut parse_lut(const char* op, const at::Tensor& lut) {
  TORCH_CHECK(lut.device().is_cpu() && lut.scalar_type() == at::kInt && lut.dim() == 1 &&
                  lut.is_contiguous() && lut.numel() >= 4,
              op, ": lut must be a contiguous 1-D int32 CPU tensor (from the layout's LUT)");
  const int32_t* p = lut.const_data_ptr<int32_t>();
  BlockLut L{};
  L.nnz = p[0];
  L.heads = p[1];
  L.nb = p[2];
  L.block = p[3];
  TORCH_CHECK(L.nnz >= 0 && L.heads > 0 && L.nb > 0 && L.block > 0, op, ": lut header is corrupt");
  const int64_t keys = L.heads * L.nb;
  TORCH_CHECK(lut.numel() == 4 + 3 * L.nnz + 2 * (keys + 1) + 2 * L.nnz, op, ": lut has ",
              lut.numel(), " entries; its header needs ", 4 + 5 * L.nnz + 2 * (keys + 1));
  L.blocks = p + 4;
  L.row_ptr = L.blocks + 3 * L.nnz;
  L.row_idx = L.row_ptr + keys + 1;
  L.col_ptr = L.row_idx + L.nnz;
  L.col_idx = L.col_ptr + keys + 1;
  for (int64_t z = 0; z < L.nnz; ++z) {
    const int32_t* b = L.blocks + 3 * z;
    TORCH_CHECK(b[0] >= 0 && b[0] < L.heads && b[1] >= 0 && b[1] < L.nb && b[2] >= 0 && b[2] < L.nb,
                op, ": lut block ", z, " is out of range");
  }
  for (const int32_t* ptr : {L.row_ptr, L.col_ptr}) {
    TORCH_CHECK(ptr[0] == 0 && ptr[keys] == L.nnz, op, ": lut pointers are corrupt");
    for (int64_t k = 0; k < keys; ++k) TORCH_CHECK(ptr[k] <= ptr[k + 1], op, ": lut pointers");
  }
  for (const int32_t* idx : {L.row_idx, L.col_idx})
    for (int64_t e = 0; e < L.nnz; ++e)
      TORCH_CHECK(idx[e] >= 0 && idx[e] < L.nnz, op, ": lut index out of range");
  return L;
}

// A dense [batch, heads, rows, cols] operand read as [rows, cols] (trans: [cols, rows]).
DenseView view_of(const char* op, const at::Tensor& t, const char* name, bool trans,
                  const BlockLut& L, int64_t batch, const at::Tensor& like) {
  check_float(op, t, name);
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but the other operand has ", like.scalar_type());
  TORCH_CHECK(t.dim() == 4 && t.size(0) == batch && t.size(1) == L.heads, op, ": ", name,
              " has shape ", t.sizes(), "; expected [", batch, ", ", L.heads, ", rows, cols]");
  return DenseView{t.const_data_ptr(), t.stride(0), t.stride(1), trans ? t.stride(3) : t.stride(2),
                   trans ? t.stride(2) : t.stride(3)};
}

int64_t rows(const at::Tensor& t, bool trans) { return t.size(trans ? 3 : 2); }
int64_t cols(const at::Tensor& t, bool trans) { return t.size(trans ? 2 : 3); }

void check_sparse(const char* op, const at::Tensor& s, const char* name, const BlockLut& L) {
  check_float(op, s, name);
  TORCH_CHECK(s.is_contiguous() && s.dim() == 4 && s.size(1) == L.nnz && s.size(2) == L.block &&
                  s.size(3) == L.block,
              op, ": ", name, " has shape ", s.sizes(), "; expected a contiguous [batch, ", L.nnz,
              ", ", L.block, ", ", L.block, "] block-sparse tensor of this layout");
}

at::Tensor sdd(const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b,
               const at::Tensor& lut, int64_t nnz, int64_t block) {
  constexpr const char* op = "sparse_attention.sdd";
  const BlockLut L = parse_lut(op, lut);
  // nnz and block travel as arguments too, so the output shape is known without reading the
  // table (torch.compile's fake implementation cannot)
  TORCH_CHECK(nnz == L.nnz && block == L.block, op, ": nnz=", nnz, " and block=", block,
              " disagree with the lut's ", L.nnz, " and ", L.block);
  const int64_t batch = a.dim() == 4 ? a.size(0) : -1;
  const DenseView A = view_of(op, a, "a", trans_a, L, batch, a);
  const DenseView B = view_of(op, b, "b", trans_b, L, batch, a);
  const int64_t side = L.nb * L.block, k = cols(a, trans_a);
  TORCH_CHECK(rows(a, trans_a) == side && cols(b, trans_b) == side && rows(b, trans_b) == k, op,
              ": a is [", rows(a, trans_a), ", ", k, "] and b [", rows(b, trans_b), ", ",
              cols(b, trans_b), "] (after transposes); the layout needs [", side, ", K] @ [K, ",
              side, "]");
  at::Tensor out = at::empty({batch, L.nnz, L.block, L.block}, a.options());
  at::parallel_for(0, batch * L.nnz, 1, [&](int64_t z0, int64_t z1) {
    ds::bsr_sdd(dtype_of(a), L, A, B, k, out.data_ptr(), z0, z1);
  });
  return out;
}

at::Tensor dsd(const at::Tensor& s, bool trans_s, const at::Tensor& b, bool trans_b,
               const at::Tensor& lut) {
  constexpr const char* op = "sparse_attention.dsd";
  const BlockLut L = parse_lut(op, lut);
  check_sparse(op, s, "a", L);
  const DenseView B = view_of(op, b, "b", trans_b, L, s.size(0), s);
  const int64_t side = L.nb * L.block, n = cols(b, trans_b);
  TORCH_CHECK(rows(b, trans_b) == side, op, ": b has ", rows(b, trans_b),
              " rows (after its transpose); the layout needs ", side);
  at::Tensor out = at::empty({s.size(0), L.heads, side, n}, s.options());
  at::parallel_for(0, s.size(0) * L.heads * L.nb, 1, [&](int64_t w0, int64_t w1) {
    ds::bsr_dsd(dtype_of(s), L, s.const_data_ptr(), trans_s, B, n, out.data_ptr(), w0, w1);
  });
  return out;
}

at::Tensor dds(const at::Tensor& a, bool trans_a, const at::Tensor& s, bool trans_s,
               const at::Tensor& lut) {
  constexpr const char* op = "sparse_attention.dds";
  const BlockLut L = parse_lut(op, lut);
  check_sparse(op, s, "b", L);
  const DenseView A = view_of(op, a, "a", trans_a, L, s.size(0), s);
  const int64_t side = L.nb * L.block, m = rows(a, trans_a);
  TORCH_CHECK(cols(a, trans_a) == side, op, ": a has ", cols(a, trans_a),
              " columns (after its transpose); the layout needs ", side);
  at::Tensor out = at::empty({s.size(0), L.heads, m, side}, s.options());
  at::parallel_for(0, s.size(0) * L.heads * L.nb, 1, [&](int64_t w0, int64_t w1) {
    ds::bsr_dds(dtype_of(s), L, A, m, s.const_data_ptr(), trans_s, out.data_ptr(), w0, w1);
  });
  return out;
}

const float* term(const char* op, const std::optional<at::Tensor>& t, const char* name,
                  int64_t dims) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == dims &&
                  t->stride(dims - 1) == 1,
              op, ": ", name, " must be a float32 CPU tensor of ", dims,
              " dimensions with a contiguous last one, got ", t->sizes(), " ", t->scalar_type());
  return t->const_data_ptr<float>();
}

at::Tensor softmax_fwd(const at::Tensor& x, double scale, const std::optional<at::Tensor>& rpe,
                       const std::optional<at::Tensor>& kp, const std::optional<at::Tensor>& attn,
                       const at::Tensor& lut) {
  constexpr const char* op = "sparse_attention.softmax_fwd";
  const BlockLut L = parse_lut(op, lut);
  check_sparse(op, x, "x", L);
  const int64_t batch = x.size(0), side = L.nb * L.block;
  ds::SoftmaxTerms t{};
  t.rpe = term(op, rpe, "rpe", 4);
  if (t.rpe != nullptr) {
    TORCH_CHECK((rpe->size(0) == batch || rpe->stride(0) == 0) && rpe->size(1) == L.heads &&
                    rpe->size(2) == side && rpe->size(3) == side,
                op, ": rpe has shape ", rpe->sizes(), "; expected [", batch, ", ", L.heads, ", ",
                side, ", ", side, "]");
    t.rpe_sb = rpe->stride(0);
    t.rpe_sh = rpe->stride(1);
    t.rpe_si = rpe->stride(2);
  }
  t.kp = term(op, kp, "key_padding_mask", 2);
  if (t.kp != nullptr) {
    TORCH_CHECK(kp->size(0) == batch && kp->size(1) == side, op, ": key_padding_mask has shape ",
                kp->sizes(), "; expected [", batch, ", ", side, "]");
    t.kp_sb = kp->stride(0);
  }
  t.attn = term(op, attn, "attn_mask", 2);
  if (t.attn != nullptr) {
    TORCH_CHECK(attn->size(0) == side && attn->size(1) == side, op, ": attn_mask has shape ",
                attn->sizes(), "; expected [", side, ", ", side, "]");
    t.attn_si = attn->stride(0);
  }
  at::Tensor y = at::empty_like(x);
  at::parallel_for(0, batch * L.heads * L.nb, 1, [&](int64_t w0, int64_t w1) {
    ds::bsr_softmax_fwd(dtype_of(x), L, x.const_data_ptr(), y.data_ptr(), static_cast<float>(scale),
                        t, w0, w1);
  });
  return y;
}

at::Tensor softmax_bwd(const at::Tensor& y, const at::Tensor& dy, double scale,
                       const at::Tensor& lut) {
  constexpr const char* op = "sparse_attention.softmax_bwd";
  const BlockLut L = parse_lut(op, lut);
  check_sparse(op, y, "y", L);
  check_sparse(op, dy, "dy", L);
  TORCH_CHECK(dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type(), op,
              ": dy must match y's shape and dtype");
  at::Tensor dx = at::empty_like(y);
  at::parallel_for(0, y.size(0) * L.heads * L.nb, 1, [&](int64_t w0, int64_t w1) {
    ds::bsr_softmax_bwd(dtype_of(y), L, y.const_data_ptr(), dy.const_data_ptr(), dx.data_ptr(),
                        static_cast<float>(scale), w0, w1);
  });
  return dx;
}

}  // namespace

// Schemas here, CPU kernels below: an op defined with its kernel in one step would be
// CompositeImplicitAutograd, which refuses the fake (meta) implementations torch.compile needs
// (registered in ops/sparse_attention/kernels.py).
TORCH_LIBRARY(ds_sparse_attention, m) {
  m.def(
      "sdd(Tensor a, bool trans_a, Tensor b, bool trans_b, Tensor lut, int nnz, int block) -> "
      "Tensor");
  m.def("dsd(Tensor a, bool trans_a, Tensor b, bool trans_b, Tensor lut) -> Tensor");
  m.def("dds(Tensor a, bool trans_a, Tensor b, bool trans_b, Tensor lut) -> Tensor");
  m.def(
      "softmax_fwd(Tensor x, float scale, Tensor? rpe, Tensor? key_padding_mask, "
      "Tensor? attn_mask, Tensor lut) -> Tensor");
  m.def("softmax_bwd(Tensor y, Tensor dy, float scale, Tensor lut) -> Tensor");
}

TORCH_LIBRARY_IMPL(ds_sparse_attention, CPU, m) {
  m.impl("sdd", &sdd);
  m.impl("dsd", &dsd);
  m.impl("dds", &dds);
  m.impl("softmax_fwd", &softmax_fwd);
  m.impl("softmax_bwd", &softmax_bwd);
}
