// torch.ops.ds_sparse_attention_cuda: block-sparse matmuls and softmax on CUDA tensors of one
// device, on the current stream ([Note: block-sparse CUDA kernels]). The CPU op's schemas and
// checks (sparse_attention_checks.h); the look-up table is the CPU op's, copied to the device
// once per layout (ops/sparse_attention/lut.py), so its size is checked here against the
// operands, and its contents where it was built. The softmax takes the head count, which its
// operands do not show.
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

#include "sparse_attention/sparse_attention_cuda.h"
#include "sparse_attention/sparse_flash_cuda.h"
#include "sparse_attention_checks.h"

namespace {

using namespace ds_bind_sa;  // NOLINT: the checks shared with the CPU binding
using ds::BlockLut;

constexpr at::DeviceType kDev = at::kCUDA;

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// The table's layout (see the CPU binding's parse_lut) from its header's values, which the
// operands give: [nnz, heads, nb, block, blocks (3 nnz), row_ptr (heads nb + 1), row_idx (nnz),
// col_ptr (heads nb + 1), col_idx (nnz)].
BlockLut lut_of(const char* op, const at::Tensor& lut, const at::Tensor& like, int64_t nnz,
                int64_t heads, int64_t side, int64_t block) {
  TORCH_CHECK(ds::bsr_cuda_block_ok(block), op, ": block=", block,
              "; the kernels take blocks of 16, 32, 64 or 128");
  TORCH_CHECK(heads > 0 && side > 0 && side % block == 0, op, ": ", side,
              " rows is not a whole number of blocks of ", block);
  TORCH_CHECK(lut.device() == like.device() && lut.scalar_type() == at::kInt && lut.dim() == 1 &&
                  lut.is_contiguous(),
              op, ": lut must be a contiguous 1-D int32 tensor on ", like.device(),
              " (the layout's LUT copied there), got ", lut.scalar_type(), " on ", lut.device());
  BlockLut L{};
  L.nnz = nnz;
  L.heads = heads;
  L.nb = side / block;
  L.block = block;
  const int64_t keys = heads * L.nb;
  TORCH_CHECK(lut.numel() == 4 + 5 * nnz + 2 * (keys + 1), op, ": lut has ", lut.numel(),
              " entries; a layout of ", heads, " heads, ", L.nb, " blocks a side and ", nnz,
              " non-zero blocks has ", 4 + 5 * nnz + 2 * (keys + 1));
  const int32_t* p = lut.const_data_ptr<int32_t>();
  L.blocks = p + 4;
  L.row_ptr = L.blocks + 3 * nnz;
  L.row_idx = L.row_ptr + keys + 1;
  L.col_ptr = L.row_idx + nnz;
  L.col_idx = L.col_ptr + keys + 1;
  return L;
}

at::Tensor sdd(const at::Tensor& a, bool trans_a, const at::Tensor& b, bool trans_b,
               const at::Tensor& lut, int64_t nnz, int64_t block) {
  constexpr const char* op = "sparse_attention_cuda.sdd";
  check_float(op, a, "a", kDev);
  TORCH_CHECK(a.dim() == 4, op, ": a has shape ", a.sizes(),
              "; expected [batch, heads, rows, cols]");
  const int64_t batch = a.size(0), heads = a.size(1), side = rows(a, trans_a);
  const BlockLut L = lut_of(op, lut, a, nnz, heads, side, block);
  const DenseView A = view_of(op, a, "a", trans_a, heads, batch, a);
  const DenseView B = view_of(op, b, "b", trans_b, heads, batch, a);
  const int64_t k = cols(a, trans_a);
  TORCH_CHECK(cols(b, trans_b) == side && rows(b, trans_b) == k, op, ": a is [", side, ", ", k,
              "] and b [", rows(b, trans_b), ", ", cols(b, trans_b),
              "] (after transposes); the layout needs [", side, ", K] @ [K, ", side, "]");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({batch, nnz, block, block}, a.options());
  C10_CUDA_CHECK(ds::bsr_sdd_cuda(dtype_of(a), L, A, B, k, out.data_ptr(), batch, stream_of(a)));
  return out;
}

at::Tensor dsd(const at::Tensor& s, bool trans_s, const at::Tensor& b, bool trans_b,
               const at::Tensor& lut) {
  constexpr const char* op = "sparse_attention_cuda.dsd";
  check_float(op, s, "a", kDev);
  TORCH_CHECK(s.dim() == 4 && b.dim() == 4, op, ": a has shape ", s.sizes(), " and b ", b.sizes(),
              "; expected [batch, nnz, block, block] and [batch, heads, rows, cols]");
  const int64_t block = s.size(2), side = rows(b, trans_b);
  const BlockLut L = lut_of(op, lut, s, s.size(1), b.size(1), side, block);
  check_sparse(op, s, "a", L.nnz, L.block, kDev);
  const DenseView B = view_of(op, b, "b", trans_b, L.heads, s.size(0), s);
  const int64_t n = cols(b, trans_b);
  const c10::cuda::CUDAGuard guard(s.device());
  at::Tensor out = at::empty({s.size(0), L.heads, side, n}, s.options());
  C10_CUDA_CHECK(ds::bsr_dsd_cuda(dtype_of(s), L, s.const_data_ptr(), trans_s, B, n, out.data_ptr(),
                                  s.size(0), stream_of(s)));
  return out;
}

at::Tensor dds(const at::Tensor& a, bool trans_a, const at::Tensor& s, bool trans_s,
               const at::Tensor& lut) {
  constexpr const char* op = "sparse_attention_cuda.dds";
  check_float(op, s, "b", kDev);
  TORCH_CHECK(s.dim() == 4 && a.dim() == 4, op, ": a has shape ", a.sizes(), " and b ", s.sizes(),
              "; expected [batch, heads, rows, cols] and [batch, nnz, block, block]");
  const int64_t block = s.size(2), side = cols(a, trans_a);
  const BlockLut L = lut_of(op, lut, s, s.size(1), a.size(1), side, block);
  check_sparse(op, s, "b", L.nnz, L.block, kDev);
  const DenseView A = view_of(op, a, "a", trans_a, L.heads, s.size(0), s);
  const int64_t m = rows(a, trans_a);
  const c10::cuda::CUDAGuard guard(s.device());
  at::Tensor out = at::empty({s.size(0), L.heads, m, side}, s.options());
  C10_CUDA_CHECK(ds::bsr_dds_cuda(dtype_of(s), L, A, m, s.const_data_ptr(), trans_s, out.data_ptr(),
                                  s.size(0), stream_of(s)));
  return out;
}

// The layout's side from the table's size: numel = 4 + 5 nnz + 2 (heads nb + 1).
int64_t side_of(const char* op, const at::Tensor& lut, int64_t nnz, int64_t heads, int64_t block) {
  const int64_t keys2 = lut.numel() - 4 - 5 * nnz - 2;
  TORCH_CHECK(heads > 0 && keys2 > 0 && keys2 % (2 * heads) == 0, op, ": lut has ", lut.numel(),
              " entries, which fits no layout of ", heads, " heads and ", nnz, " blocks");
  return keys2 / (2 * heads) * block;
}

at::Tensor softmax_fwd(const at::Tensor& x, double scale, const std::optional<at::Tensor>& rpe,
                       const std::optional<at::Tensor>& kp, const std::optional<at::Tensor>& attn,
                       const at::Tensor& lut, int64_t heads) {
  constexpr const char* op = "sparse_attention_cuda.softmax_fwd";
  check_float(op, x, "x", kDev);
  TORCH_CHECK(x.dim() == 4, op, ": x has shape ", x.sizes(),
              "; expected [batch, nnz, block, block]");
  const int64_t nnz = x.size(1), block = x.size(2);
  const int64_t side = side_of(op, lut, nnz, heads, block);
  const BlockLut L = lut_of(op, lut, x, nnz, heads, side, block);
  check_sparse(op, x, "x", nnz, block, kDev);
  const ds::SoftmaxTerms t = softmax_terms(op, x, heads, side, rpe, kp, attn);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  C10_CUDA_CHECK(ds::bsr_softmax_fwd_cuda(dtype_of(x), L, x.const_data_ptr(), y.data_ptr(),
                                          static_cast<float>(scale), t, x.size(0), stream_of(x)));
  return y;
}

at::Tensor softmax_bwd(const at::Tensor& y, const at::Tensor& dy, double scale,
                       const at::Tensor& lut, int64_t heads) {
  constexpr const char* op = "sparse_attention_cuda.softmax_bwd";
  check_float(op, y, "y", kDev);
  TORCH_CHECK(y.dim() == 4, op, ": y has shape ", y.sizes(),
              "; expected [batch, nnz, block, block]");
  const int64_t nnz = y.size(1), block = y.size(2);
  const BlockLut L = lut_of(op, lut, y, nnz, heads, side_of(op, lut, nnz, heads, block), block);
  check_sparse(op, y, "y", nnz, block, kDev);
  check_sparse(op, dy, "dy", nnz, block, kDev);
  TORCH_CHECK(
      dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type() && dy.device() == y.device(),
      op, ": dy must match y's shape, dtype and device");
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor dx = at::empty_like(y);
  C10_CUDA_CHECK(ds::bsr_softmax_bwd_cuda(dtype_of(y), L, y.const_data_ptr(), dy.const_data_ptr(),
                                          dx.data_ptr(), static_cast<float>(scale), y.size(0),
                                          stream_of(y)));
  return dx;
}

// Fused attention's dense operands: contiguous [batch, heads, seq, head_dim] of `like`'s shape,
// dtype (fp16 or bf16) and device.
void check_dense16(const char* op, const at::Tensor& t, const char* name, const at::Tensor& like) {
  check_float(op, t, name, kDev);
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op, ": ", name,
              " has dtype ", t.scalar_type(),
              "; the fused kernels take float16 or bfloat16 (float32 runs unfused)");
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.device() == like.device(), op, ": ", name,
              " is ", t.scalar_type(), " on ", t.device(), " but q is ", like.scalar_type(), " on ",
              like.device());
  TORCH_CHECK(t.dim() == 4 && t.sizes() == like.sizes() && t.is_contiguous(), op, ": ", name,
              " has shape ", t.sizes(), (t.is_contiguous() ? "" : " (not contiguous)"),
              "; expected a contiguous [batch, heads, seq, head_dim] of q's shape ", like.sizes());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0, op, ": ", name,
              " starts at an address that is not a multiple of 16 bytes (a view at an odd offset); "
              "pass a copy (.clone())");
}

// The layout's table for fused attention on q ([batch, heads, seq, head_dim]): the block and
// head size the kernels take, a device of compute capability 8.0 or later (bf16 tensor cores).
BlockLut flash_lut(const char* op, const at::Tensor& q, const at::Tensor& lut, int64_t block) {
  check_dense16(op, q, "q", q);
  const int64_t heads = q.size(1), seq = q.size(2), head_dim = q.size(3);
  TORCH_CHECK(ds::bsr_flash_ok(block, head_dim), op, ": block=", block, ", head_dim=", head_dim,
              "; the fused kernels take blocks of 64 or 128 and head_dim 64 or 128");
  TORCH_CHECK(seq > 0 && seq % block == 0, op, ": seq=", seq,
              " is not a whole number of blocks of ", block);
  const int64_t keys = heads * (seq / block), rest = lut.numel() - 4 - 2 * (keys + 1);
  TORCH_CHECK(rest >= 0 && rest % 5 == 0, op, ": lut has ", lut.numel(),
              " entries, which fits no layout of ", heads, " heads and ", seq / block,
              " blocks a side");
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device()));
  TORCH_CHECK(major >= 8, op, ": ", q.device(), " has compute capability ", major, ".", minor,
              "; the fused kernels need 8.0 or later");
  return lut_of(op, lut, q, rest / 5, heads, seq, block);
}

// The optional tile mask (int32, one per block of a table of block 64) and key bias (fp32
// [batch, seq]) of fused attention ([Note: fused tile masks]), checked against q and the table.
ds::FlashExtras flash_extras(const char* op, const at::Tensor& q, const BlockLut& L,
                             const std::optional<at::Tensor>& tile_mask,
                             const std::optional<at::Tensor>& key_bias) {
  ds::FlashExtras x{nullptr, nullptr};
  if (tile_mask) {
    const at::Tensor& m = *tile_mask;
    TORCH_CHECK(L.block == 64, op,
                ": a tile_mask goes with a table of block 64 (a finer layout "
                "made coarse), got block=",
                L.block);
    TORCH_CHECK(m.device() == q.device() && m.scalar_type() == at::kInt && m.dim() == 1 &&
                    m.numel() == L.nnz && m.is_contiguous(),
                op, ": tile_mask must be a contiguous 1-D int32 tensor of the table's ", L.nnz,
                " blocks on ", q.device(), ", got ", m.scalar_type(), " ", m.sizes(), " on ",
                m.device());
    x.tile_mask = m.const_data_ptr<int32_t>();
  }
  if (key_bias) {
    const at::Tensor& b = *key_bias;
    TORCH_CHECK(b.device() == q.device() && b.scalar_type() == at::kFloat && b.dim() == 2 &&
                    b.size(0) == q.size(0) && b.size(1) == q.size(2) && b.is_contiguous(),
                op, ": key_bias must be a contiguous float32 [", q.size(0), ", ", q.size(2),
                "] (batch, seq) on ", q.device(), ", got ", b.scalar_type(), " ", b.sizes(), " on ",
                b.device());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(b.const_data_ptr()) % 8 == 0, op,
                ": key_bias starts at an address that is not a multiple of 8 bytes (a view at an "
                "odd offset); pass a copy (.clone())");
    x.key_bias = b.const_data_ptr<float>();
  }
  return x;
}

std::tuple<at::Tensor, at::Tensor> flash_fwd(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& lut,
                                             int64_t block, double scale,
                                             const std::optional<at::Tensor>& tile_mask,
                                             const std::optional<at::Tensor>& key_bias) {
  constexpr const char* op = "sparse_attention_cuda.flash_fwd";
  const BlockLut L = flash_lut(op, q, lut, block);
  check_dense16(op, k, "k", q);
  check_dense16(op, v, "v", q);
  const ds::FlashExtras extras = flash_extras(op, q, L, tile_mask, key_bias);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor o = at::empty_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  C10_CUDA_CHECK(ds::bsr_flash_fwd_cuda(dtype_of(q), L, q.const_data_ptr(), k.const_data_ptr(),
                                        v.const_data_ptr(), o.data_ptr(), lse.data_ptr<float>(),
                                        q.size(0), q.size(3), static_cast<float>(scale), extras,
                                        stream_of(q)));
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const at::Tensor& dout, const at::Tensor& lut, int64_t block,
    double scale, const std::optional<at::Tensor>& tile_mask,
    const std::optional<at::Tensor>& key_bias) {
  constexpr const char* op = "sparse_attention_cuda.flash_bwd";
  const BlockLut L = flash_lut(op, q, lut, block);
  const ds::FlashExtras extras = flash_extras(op, q, L, tile_mask, key_bias);
  check_dense16(op, k, "k", q);
  check_dense16(op, v, "v", q);
  check_dense16(op, o, "o", q);
  check_dense16(op, dout, "dout", q);
  TORCH_CHECK(lse.device() == q.device() && lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                  lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                  lse.size(2) == q.size(2) && lse.is_contiguous(),
              op, ": lse must be the forward's contiguous float32 [", q.size(0), ", ", q.size(1),
              ", ", q.size(2), "] on ", q.device(), ", got ", lse.sizes(), " ", lse.scalar_type(),
              " on ", lse.device());
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor dvec = at::empty_like(lse);
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  C10_CUDA_CHECK(ds::bsr_flash_bwd_cuda(
      dtype_of(q), L, q.const_data_ptr(), k.const_data_ptr(), v.const_data_ptr(),
      o.const_data_ptr(), lse.const_data_ptr<float>(), dout.const_data_ptr(),
      dvec.data_ptr<float>(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), q.size(0), q.size(3),
      static_cast<float>(scale), extras, stream_of(q)));
  return {dq, dk, dv};
}

template <class M>
void impl_all(M& m) {
  m.impl("flash_fwd", &flash_fwd);
  m.impl("flash_bwd", &flash_bwd);
  m.impl("sdd", &sdd);
  m.impl("dsd", &dsd);
  m.impl("dds", &dds);
  m.impl("softmax_fwd", &softmax_fwd);
  m.impl("softmax_bwd", &softmax_bwd);
}

}  // namespace

TORCH_LIBRARY(ds_sparse_attention_cuda, m) {
  ds_bind_sa::def_products(m);
  m.def(
      "softmax_fwd(Tensor x, float scale, Tensor? rpe, Tensor? key_padding_mask, "
      "Tensor? attn_mask, Tensor lut, int heads) -> Tensor");
  m.def("softmax_bwd(Tensor y, Tensor dy, float scale, Tensor lut, int heads) -> Tensor");
  m.def(
      "flash_fwd(Tensor q, Tensor k, Tensor v, Tensor lut, int block, float scale, "
      "Tensor? tile_mask=None, Tensor? key_bias=None) -> (Tensor, Tensor)");
  m.def(
      "flash_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor dout, Tensor lut, "
      "int block, float scale, Tensor? tile_mask=None, Tensor? key_bias=None) -> (Tensor, Tensor, "
      "Tensor)");
}

TORCH_LIBRARY_IMPL(ds_sparse_attention_cuda, CUDA, m) { impl_all(m); }

// CPU tensors reach the same functions, whose checks refuse them by name (rather than the
// dispatcher's "could not run with arguments from the CPU backend").
TORCH_LIBRARY_IMPL(ds_sparse_attention_cuda, CPU, m) { impl_all(m); }
