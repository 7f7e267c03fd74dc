// The whole transformer layer as one op each way, forward and backward
// ([Note: transformer layer op]), shared by the CPU and CUDA bindings. Bindings only: this header
// composes at::Tensor GEMMs (the vendor BLAS) with the op's checked kernels, K.
//
// [Note: transformer layer op]
// A layer built from a dozen small autograd functions spends more time in Python and the
// dispatcher than on a GPU at BERT sizes: each op is a few microseconds of GPU work. So the
// layer runs as two calls: layer_fwd returns the output and the tensors backward needs (which
// ones depends on the memory options, [Note: transformer memory options] in layer.py);
// layer_bwd takes them back and returns the input's and all twelve parameters' gradients. K is
// a struct of the binding's kernels and their device: layer_norm_fwd/bwd, bias_gelu_fwd/bwd,
// bias_dropout_residual, dropout, softmax_fwd/bwd.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "transformer_checks.h"

namespace ds_bind_tf {

// upstream's parameter order (layer.py's PARAM_NAMES)
enum Param { kQkvW, kQkvB, kOW, kOB, kAttnNW, kAttnNB, kInterW, kInterB, kOutW, kOutB, kNW, kNB };
constexpr int kParams = 12;

struct LayerOptions {
  int64_t heads;
  double p_attn, p_hid, eps;
  int64_t seed, off_attn, off_res1, off_res2;
  bool pre_ln, invertible, gelu_ckpt, attn_drop_ckpt;
};

// What backward may need, by slot; keep_slots says which ones an option set keeps.
enum Slot {
  sQkv,      // [3, b, heads, s, d] the projections, head-major (q, k and v for backward)
  sProbs,    // softmax output
  sDropped,  // its dropout (recomputed under attn_dropout_checkpoint)
  sCtx,      // [T, h] attention context (attention-output weight gradient)
  sAttnIn,   // [T, h] qkv GEMM input: the first LayerNorm's output, or x (post-LN)
  sX,        // x, the first LayerNorm's input (pre-LN, not invertible)
  sMean1,
  sRstd1,
  sAddRes,  // attention residual sum, the second LayerNorm's input (not invertible)
  sFfIn,    // second LayerNorm's output
  sMean2,
  sRstd2,
  sInter,   // pre-GeLU activations
  sGelu,    // GeLU output (recomputed under gelu_checkpoint)
  sOutSrc,  // post-LN: the last LayerNorm's input, or its output (invertible)
  sMean3,
  sRstd3,
  kSlots
};

using Slots = std::array<at::Tensor, kSlots>;

inline std::array<bool, kSlots> keep_slots(const LayerOptions& o) {
  std::array<bool, kSlots> k{};
  k[sQkv] = k[sProbs] = k[sCtx] = k[sAttnIn] = k[sFfIn] = k[sMean2] = k[sRstd2] = k[sInter] = true;
  k[sDropped] = o.p_attn > 0 && !o.attn_drop_ckpt;
  k[sX] = o.pre_ln && !o.invertible;
  k[sMean1] = k[sRstd1] = o.pre_ln;
  k[sAddRes] = !o.invertible;
  k[sGelu] = !o.gelu_ckpt;
  k[sOutSrc] = k[sMean3] = k[sRstd3] = !o.pre_ln;
  return k;
}

inline LayerOptions layer_options(const char* op, int64_t heads, double p_attn, double p_hid,
                                  double eps, int64_t seed, int64_t off_attn, int64_t off_res1,
                                  int64_t off_res2, bool pre_ln, bool invertible, bool gelu_ckpt,
                                  bool attn_drop_ckpt) {
  TORCH_CHECK(heads > 0, op, ": heads must be > 0, got ", heads);
  TORCH_CHECK(eps > 0 && eps < 1, op, ": eps must be in (0, 1), got ", eps);
  check_dropout(op, p_attn, seed, off_attn);  // each dropout call's p, seed and offset
  check_dropout(op, p_hid, seed, off_res1);
  check_dropout(op, p_hid, seed, off_res2);
  return {heads,    p_attn,   p_hid,  eps,        seed,      off_attn,
          off_res1, off_res2, pre_ln, invertible, gelu_ckpt, attn_drop_ckpt};
}

// The twelve parameters: upstream's shapes for hidden h (intermediate from inter_w), every one
// contiguous, of x's dtype, on x's device.
inline int64_t check_params(const char* op, const std::vector<at::Tensor>& P, const at::Tensor& x,
                            int64_t h) {
  static const char* names[kParams] = {"attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob",
                                       "attn_nw",   "attn_nb",   "inter_w", "inter_b",
                                       "output_w",  "output_b",  "norm_w",  "norm_b"};
  TORCH_CHECK(P.size() == kParams, op, ": expected 12 parameters, got ", P.size());
  for (int i = 0; i < kParams; ++i) check(op, P[i], names[i], &x, x.device().type());
  TORCH_CHECK(P[kInterW].dim() == 2, op, ": inter_w must be 2-D, got ", P[kInterW].sizes());
  const int64_t inter = P[kInterW].size(0);
  const std::vector<int64_t> want[kParams] = {{3 * h, h}, {3 * h}, {h, h},     {h}, {h}, {h},
                                              {inter, h}, {inter}, {h, inter}, {h}, {h}, {h}};
  for (int i = 0; i < kParams; ++i) {
    TORCH_CHECK(P[i].sizes() == at::IntArrayRef(want[i]), op, ": ", names[i], " has shape ",
                P[i].sizes(), "; expected ", at::IntArrayRef(want[i]), " for hidden size ", h);
  }
  return inter;
}

inline at::Tensor rows_sum(const at::Tensor& t) { return t.sum({0}, false, at::kFloat); }

template <class K>
std::tuple<at::Tensor, std::vector<at::Tensor>> layer_forward(const char* op,
                                                              const at::Tensor& x_in,
                                                              const std::optional<at::Tensor>& mask,
                                                              const std::vector<at::Tensor>& P,
                                                              const LayerOptions& o, bool save) {
  TORCH_CHECK(x_in.dim() == 3, op, ": hidden_states must be [batch, seq, hidden], got ",
              x_in.sizes());
  const int64_t b = x_in.size(0), s = x_in.size(1), h = x_in.size(2), H = o.heads;
  TORCH_CHECK(h % H == 0, op, ": hidden size ", h, " is not divisible by heads ", H);
  const at::Tensor x = x_in.contiguous().view({b * s, h});
  check(op, x, "hidden_states", nullptr, K::device);
  check_params(op, P, x, h);
  const int64_t d = h / H;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Slots S;

  at::Tensor attn_in = x;
  if (o.pre_ln)
    std::tie(attn_in, S[sMean1], S[sRstd1]) = K::layer_norm_fwd(x, P[kNW], P[kNB], o.eps);
  // one copy into head-major order, so no GEMM below (nor in backward) copies q, k or v again
  const at::Tensor qkv5 = P[kQkvB]
                              .addmm(attn_in, P[kQkvW].t())
                              .view({b, s, 3, H, d})
                              .permute({2, 0, 3, 1, 4})
                              .contiguous();  // [3, b, H, s, d]
  const at::Tensor probs =
      K::softmax_fwd(at::matmul(qkv5[0], qkv5[1].transpose(-1, -2)), mask, scale);
  const at::Tensor dropped = o.p_attn > 0 ? K::dropout(probs, o.p_attn, o.seed, o.off_attn) : probs;
  const at::Tensor ctx = at::matmul(dropped, qkv5[2]).transpose(1, 2).reshape({b * s, h});
  const at::Tensor add_res =
      K::bias_dropout_residual(ctx.mm(P[kOW].t()), P[kOB], x, o.p_hid, o.seed, o.off_res1);
  auto [ff_in, mean2, rstd2] = K::layer_norm_fwd(add_res, P[kAttnNW], P[kAttnNB], o.eps);
  const at::Tensor inter = ff_in.mm(P[kInterW].t());
  const at::Tensor gelu = K::bias_gelu_fwd(inter, P[kInterB]);
  at::Tensor out = K::bias_dropout_residual(
      gelu.mm(P[kOutW].t()), P[kOutB], o.pre_ln ? add_res : ff_in, o.p_hid, o.seed, o.off_res2);
  if (!o.pre_ln) {
    at::Tensor pre_norm = out;
    std::tie(out, S[sMean3], S[sRstd3]) = K::layer_norm_fwd(pre_norm, P[kNW], P[kNB], o.eps);
    S[sOutSrc] = o.invertible ? out : pre_norm;
  }
  std::vector<at::Tensor> saved;
  if (save) {
    S[sQkv] = qkv5, S[sProbs] = probs, S[sDropped] = dropped, S[sCtx] = ctx;
    S[sAttnIn] = attn_in, S[sX] = x, S[sAddRes] = add_res, S[sFfIn] = ff_in;
    S[sMean2] = mean2, S[sRstd2] = rstd2, S[sInter] = inter, S[sGelu] = gelu;
    const auto keep = keep_slots(o);
    for (int i = 0; i < kSlots; ++i) {
      if (keep[i]) saved.push_back(S[i]);
    }
  }
  return {out.view({b, s, h}), std::move(saved)};
}

template <class K>
std::tuple<at::Tensor, std::vector<at::Tensor>> layer_backward(const char* op,
                                                               const at::Tensor& dout_in,
                                                               const std::vector<at::Tensor>& saved,
                                                               const std::vector<at::Tensor>& P,
                                                               const LayerOptions& o) {
  TORCH_CHECK(dout_in.dim() == 3, op, ": the output gradient must be [batch, seq, hidden], got ",
              dout_in.sizes());
  const int64_t b = dout_in.size(0), s = dout_in.size(1), h = dout_in.size(2), H = o.heads;
  TORCH_CHECK(h % H == 0, op, ": hidden size ", h, " is not divisible by heads ", H);
  const int64_t T = b * s, d = h / H;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  at::Tensor dout = dout_in.contiguous().view({T, h});
  check(op, dout, "dout", nullptr, K::device);
  check_params(op, P, dout, h);
  const auto keep = keep_slots(o);
  Slots S;
  size_t next = 0;
  for (int i = 0; i < kSlots; ++i) {
    if (!keep[i]) continue;
    TORCH_CHECK(next < saved.size(), op, ": ", saved.size(),
                " saved tensors; these options need more (saved by another layer_fwd call?)");
    S[i] = saved[next++];
  }
  TORCH_CHECK(next == saved.size(), op, ": ", saved.size(), " saved tensors; these options keep ",
              next);
  std::vector<at::Tensor> G(kParams);

  if (!o.pre_ln) {
    std::tie(dout, G[kNW], G[kNB]) =
        K::layer_norm_bwd(dout, S[sOutSrc], o.invertible, P[kNW], P[kNB], S[sMean3], S[sRstd3]);
  }
  // out = residual + dropout(gelu @ output_w^T + output_b)
  const at::Tensor d_ff = o.p_hid > 0 ? K::dropout(dout, o.p_hid, o.seed, o.off_res2) : dout;
  G[kOutB] = rows_sum(d_ff);
  const at::Tensor gelu = o.gelu_ckpt ? K::bias_gelu_fwd(S[sInter], P[kInterB]) : S[sGelu];
  G[kOutW] = d_ff.t().mm(gelu);
  const at::Tensor d_inter = K::bias_gelu_bwd(d_ff.mm(P[kOutW]), S[sInter], P[kInterB]);
  G[kInterB] = rows_sum(d_inter);
  G[kInterW] = d_inter.t().mm(S[sFfIn]);
  at::Tensor d_ff_in = d_inter.mm(P[kInterW]);
  if (!o.pre_ln) d_ff_in.add_(dout);  // post-LN: ff_in was the residual
  auto [d_add_res, dgn2, dbn2] =
      K::layer_norm_bwd(d_ff_in, o.invertible ? S[sFfIn] : S[sAddRes], o.invertible, P[kAttnNW],
                        P[kAttnNB], S[sMean2], S[sRstd2]);
  G[kAttnNW] = dgn2, G[kAttnNB] = dbn2;
  if (o.pre_ln) d_add_res.add_(dout);  // pre-LN: add_res was the residual
  // add_res = x + dropout(ctx @ attn_ow^T + attn_ob)
  const at::Tensor d_ao =
      o.p_hid > 0 ? K::dropout(d_add_res, o.p_hid, o.seed, o.off_res1) : d_add_res;
  G[kOB] = rows_sum(d_ao);
  G[kOW] = d_ao.t().mm(S[sCtx]);
  const at::Tensor d_ctx =
      d_ao.mm(P[kOW]).view({b, s, H, d}).transpose(1, 2).contiguous();  // [b, H, s, d], used twice
  const at::Tensor& qkv5 = S[sQkv];
  const at::Tensor& probs = S[sProbs];
  at::Tensor dropped = probs;
  if (o.p_attn > 0) {
    dropped = o.attn_drop_ckpt ? K::dropout(probs, o.p_attn, o.seed, o.off_attn) : S[sDropped];
  }
  const at::Tensor d_v = at::matmul(dropped.transpose(-1, -2), d_ctx);
  at::Tensor d_probs = at::matmul(d_ctx, qkv5[2].transpose(-1, -2));
  if (o.p_attn > 0) d_probs = K::dropout(d_probs, o.p_attn, o.seed, o.off_attn);
  const at::Tensor d_scores = K::softmax_bwd(d_probs, probs, scale);
  const at::Tensor d_q = at::matmul(d_scores, qkv5[1]);
  const at::Tensor d_k = at::matmul(d_scores.transpose(-1, -2), qkv5[0]);
  const at::Tensor d_qkv =
      at::stack({d_q.transpose(1, 2), d_k.transpose(1, 2), d_v.transpose(1, 2)}, 2)
          .view({T, 3 * h});  // [b, s, 3, H, d] as the projections' layout
  G[kQkvB] = rows_sum(d_qkv);
  G[kQkvW] = d_qkv.t().mm(S[sAttnIn]);
  at::Tensor dx = d_qkv.mm(P[kQkvW]);
  if (o.pre_ln) {
    at::Tensor dln;
    std::tie(dln, G[kNW], G[kNB]) = K::layer_norm_bwd(
        dx, o.invertible ? S[sAttnIn] : S[sX], o.invertible, P[kNW], P[kNB], S[sMean1], S[sRstd1]);
    dx = dln;
  }
  dx.add_(d_add_res);  // x was the attention residual
  for (int i = 0; i < kParams; ++i) G[i] = G[i].to(P[i].scalar_type());
  return {dx.view({b, s, h}), std::move(G)};
}

// The ops' entry points: the binding's op-name prefix and kernels; the schemas are LAYER_FWD_SCHEMA
// and LAYER_BWD_SCHEMA.
#define DS_LAYER_SCALARS                                                                  \
  int64_t heads, double p_attn, double p_hid, double eps, int64_t seed, int64_t off_attn, \
      int64_t off_res1, int64_t off_res2, bool pre_ln, bool invertible, bool gelu_ckpt,   \
      bool attn_drop_ckpt
#define DS_LAYER_SCALAR_NAMES                                                                   \
  heads, p_attn, p_hid, eps, seed, off_attn, off_res1, off_res2, pre_ln, invertible, gelu_ckpt, \
      attn_drop_ckpt
#define DS_LAYER_SCALAR_SCHEMA                                                              \
  "int heads, float p_attn, float p_hid, float eps, int seed, int off_attn, int off_res1, " \
  "int off_res2, bool pre_ln, bool invertible, bool gelu_ckpt, bool attn_drop_ckpt"
#define LAYER_FWD_SCHEMA                                                       \
  "layer_fwd(Tensor x, Tensor? mask, Tensor[] params, " DS_LAYER_SCALAR_SCHEMA \
  ", bool save) -> (Tensor, Tensor[])"
#define LAYER_BWD_SCHEMA                                                            \
  "layer_bwd(Tensor dout, Tensor[] saved, Tensor[] params, " DS_LAYER_SCALAR_SCHEMA \
  ") -> (Tensor, Tensor[])"

template <class K>
std::tuple<at::Tensor, std::vector<at::Tensor>> layer_fwd_op(const char* op, const at::Tensor& x,
                                                             const std::optional<at::Tensor>& mask,
                                                             at::TensorList params,
                                                             DS_LAYER_SCALARS, bool save) {
  const LayerOptions o = layer_options(op, DS_LAYER_SCALAR_NAMES);
  return layer_forward<K>(op, x, mask, params.vec(), o, save);
}

template <class K>
std::tuple<at::Tensor, std::vector<at::Tensor>> layer_bwd_op(const char* op, const at::Tensor& dout,
                                                             at::TensorList saved,
                                                             at::TensorList params,
                                                             DS_LAYER_SCALARS) {
  const LayerOptions o = layer_options(op, DS_LAYER_SCALAR_NAMES);
  return layer_backward<K>(op, dout, saved.vec(), params.vec(), o);
}

}  // namespace ds_bind_tf

// In a binding's unnamed namespace, after its kernels: the Kernels struct the layer op
// composes (the binding's functions, on its device kDev) and the two op functions, layer_fwd
// and layer_bwd, named "<prefix>.layer_fwd" / ".layer_bwd" in errors. The kernels set their
// own device guards.
#define DS_DEFINE_LAYER_OPS(prefix)                                                            \
  struct Kernels {                                                                             \
    static constexpr at::DeviceType device = kDev;                                             \
    static constexpr auto layer_norm_fwd = &::layer_norm_fwd;                                  \
    static constexpr auto layer_norm_bwd = &::layer_norm_bwd;                                  \
    static constexpr auto bias_gelu_fwd = &::bias_gelu_fwd;                                    \
    static constexpr auto bias_gelu_bwd = &::bias_gelu_bwd;                                    \
    static constexpr auto bias_dropout_residual = &::bias_dropout_residual;                    \
    static constexpr auto dropout = &::dropout;                                                \
    static constexpr auto softmax_fwd = &::softmax_fwd;                                        \
    static constexpr auto softmax_bwd = &::softmax_bwd;                                        \
  };                                                                                           \
  std::tuple<at::Tensor, std::vector<at::Tensor>> layer_fwd(                                   \
      const at::Tensor& x, const std::optional<at::Tensor>& mask, at::TensorList params,       \
      DS_LAYER_SCALARS, bool save) {                                                           \
    return ds_bind_tf::layer_fwd_op<Kernels>(prefix ".layer_fwd", x, mask, params,             \
                                             DS_LAYER_SCALAR_NAMES, save);                     \
  }                                                                                            \
  std::tuple<at::Tensor, std::vector<at::Tensor>> layer_bwd(                                   \
      const at::Tensor& dout, at::TensorList saved, at::TensorList params, DS_LAYER_SCALARS) { \
    return ds_bind_tf::layer_bwd_op<Kernels>(prefix ".layer_bwd", dout, saved, params,         \
                                             DS_LAYER_SCALAR_NAMES);                           \
  }
