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
#include "sparse_attention_checks.h"

namespace {

using namespace ds_bind_sa;  // NOLINT: the checks shared with the CUDA binding
using ds::BlockLut;

constexpr at::DeviceType kDev = at::kCPU;

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

at::Tensor sdd(const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b,
               const at::Tensor& lut, int64_t nnz, int64_t block) {
  constexpr const char* op = "sparse_attention.sdd";
  const BlockLut L = parse_lut(op, lut);
  // nnz and block travel as arguments too, so the output shape is known without reading the
  // table (torch.compile's fake implementation cannot)
  TORCH_CHECK(nnz == L.nnz && block == L.block, op, ": nnz=", nnz, " and block=", block,
              " disagree with the lut's ", L.nnz, " and ", L.block);
  const int64_t batch = a.dim() == 4 ? a.size(0) : -1;
  const DenseView A = view_of(op, a, "a", trans_a, L.heads, batch, a);
  const DenseView B = view_of(op, b, "b", trans_b, L.heads, batch, a);
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
  check_sparse(op, s, "a", L.nnz, L.block, kDev);
  const DenseView B = view_of(op, b, "b", trans_b, L.heads, s.size(0), s);
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
  check_sparse(op, s, "b", L.nnz, L.block, kDev);
  const DenseView A = view_of(op, a, "a", trans_a, L.heads, s.size(0), s);
  const int64_t side = L.nb * L.block, m = rows(a, trans_a);
  TORCH_CHECK(cols(a, trans_a) == side, op, ": a has ", cols(a, trans_a),
              " columns (after its transpose); the layout needs ", side);
  at::Tensor out = at::empty({s.size(0), L.heads, m, side}, s.options());
  at::parallel_for(0, s.size(0) * L.heads * L.nb, 1, [&](int64_t w0, int64_t w1) {
    ds::bsr_dds(dtype_of(s), L, A, m, s.const_data_ptr(), trans_s, out.data_ptr(), w0, w1);
  });
  return out;
}

at::Tensor softmax_fwd(const at::Tensor& x, double scale, const std::optional<at::Tensor>& rpe,
                       const std::optional<at::Tensor>& kp, const std::optional<at::Tensor>& attn,
                       const at::Tensor& lut) {
  constexpr const char* op = "sparse_attention.softmax_fwd";
  const BlockLut L = parse_lut(op, lut);
  check_sparse(op, x, "x", L.nnz, L.block, kDev);
  const int64_t batch = x.size(0), side = L.nb * L.block;
  const ds::SoftmaxTerms t = softmax_terms(op, x, L.heads, side, rpe, kp, attn);
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
  check_sparse(op, y, "y", L.nnz, L.block, kDev);
  check_sparse(op, dy, "dy", L.nnz, L.block, kDev);
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
  ds_bind_sa::def_products(m);
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
