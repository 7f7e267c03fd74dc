// CPU kernels of the fused transformer layer ([Note: transformer kernels]).
//
// [Note: transformer kernels]
// The layer's element-wise and row-wise steps, each one pass over memory: LayerNorm (forward
// saves per-row mean and 1/std; backward can start from the output instead of the input),
// bias + GeLU, bias + dropout + residual, dropout, and the scaled, masked softmax. GEMMs stay
// with the vendor BLAS (torch). Rows are independent, so the binding splits rows across
// threads; within a row, plain fp32 loops that the compiler vectorizes at the op's SIMD level.
#include "transformer/transformer.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fast_math.h"
#include "half.h"
#include "transformer/dropout_rng.h"

namespace ds {
namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

template <class T>
void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = to_float(src[j]);
}

template <class T>
void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) from_float(src[j], dst + j);
}

template <class T>
void ln_fwd(const T* x, const T* gamma, const T* beta, T* y, float* mean, float* rstd, int64_t r0,
            int64_t r1, int64_t h, float eps) {
  std::vector<float> row(h), g(h), b(h);
  load_row(gamma, g.data(), h);
  load_row(beta, b.data(), h);
  for (int64_t r = r0; r < r1; ++r) {
    load_row(x + r * h, row.data(), h);
    float sum = 0.f;  // two-pass: the offset leaves before squaring, so float sums suffice
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < h; ++j) sum += row[j];
    const float m = sum / static_cast<float>(h);
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < h; ++j) sq += (row[j] - m) * (row[j] - m);
    const float rs = 1.f / std::sqrt(sq / static_cast<float>(h) + eps);
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) row[j] = (row[j] - m) * rs * g[j] + b[j];
    store_row(row.data(), y + r * h, h);
    mean[r] = m;
    rstd[r] = rs;
  }
}

template <class T>
void ln_bwd(const T* dy, const T* src, bool src_is_output, const T* gamma, const T* beta,
            const float* mean, const float* rstd, T* dx, float* dgamma, float* dbeta, int64_t r0,
            int64_t r1, int64_t h) {
  std::vector<float> g(h), b(h), xhat(h), dxhat(h), dyr(h);
  load_row(gamma, g.data(), h);
  load_row(beta, b.data(), h);
  for (int64_t r = r0; r < r1; ++r) {
    load_row(src + r * h, xhat.data(), h);
    if (src_is_output) {
      for (int64_t j = 0; j < h; ++j) xhat[j] = (xhat[j] - b[j]) / g[j];
    } else {
      for (int64_t j = 0; j < h; ++j) xhat[j] = (xhat[j] - mean[r]) * rstd[r];
    }
    load_row(dy + r * h, dyr.data(), h);
    float a = 0.f, c = 0.f;  // mean(dxhat), mean(dxhat * xhat)
#pragma omp simd reduction(+ : a, c)
    for (int64_t j = 0; j < h; ++j) {
      dxhat[j] = dyr[j] * g[j];
      a += dxhat[j];
      c += dxhat[j] * xhat[j];
      dgamma[j] += dyr[j] * xhat[j];
      dbeta[j] += dyr[j];
    }
    a /= h;
    c /= h;
    const float rs = rstd[r];
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) dxhat[j] = rs * (dxhat[j] - a - xhat[j] * c);
    store_row(dxhat.data(), dx + r * h, h);
  }
}

inline float gelu(float u) {
  return 0.5f * u * (1.f + fast_tanh(kGeluK * (u + kGeluC * u * u * u)));
}

inline float gelu_grad(float u) {
  const float t = fast_tanh(kGeluK * (u + kGeluC * u * u * u));
  return 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * kGeluK * (1.f + 3.f * kGeluC * u * u);
}

template <class T>
void gelu_fwd(const T* x, const T* bias, T* y, int64_t r0, int64_t r1, int64_t n) {
  std::vector<float> b(n), row(n);
  load_row(bias, b.data(), n);
  for (int64_t r = r0; r < r1; ++r) {
    load_row(x + r * n, row.data(), n);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] = gelu(row[j] + b[j]);
    store_row(row.data(), y + r * n, n);
  }
}

template <class T>
void gelu_bwd(const T* dy, const T* x, const T* bias, T* dx, int64_t r0, int64_t r1, int64_t n) {
  std::vector<float> b(n), row(n), d(n);
  load_row(bias, b.data(), n);
  for (int64_t r = r0; r < r1; ++r) {
    load_row(x + r * n, row.data(), n);
    load_row(dy + r * n, d.data(), n);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) d[j] *= gelu_grad(row[j] + b[j]);
    store_row(d.data(), dx + r * n, n);
  }
}

template <class T>
void bias_drop_res(const T* x, const T* bias, const T* res, T* out, float p, uint64_t seed,
                   uint64_t offset, int64_t r0, int64_t r1, int64_t n) {
  DropoutMask mask(seed, drop_threshold(p));
  const float scale = dropout_scale(p);
  std::vector<float> b(n);
  load_row(bias, b.data(), n);
  for (int64_t r = r0; r < r1; ++r) {
    const uint64_t base = offset + static_cast<uint64_t>(r * n);
    for (int64_t j = 0; j < n; ++j) {
      const float v = to_float(x[r * n + j]) + b[j];
      const float kept = mask.keep(base + j) ? v * scale : 0.f;
      from_float(to_float(res[r * n + j]) + kept, out + r * n + j);
    }
  }
}

template <class T>
void drop_apply(const T* x, T* out, float p, uint64_t seed, uint64_t offset, int64_t e0,
                int64_t e1) {
  DropoutMask mask(seed, drop_threshold(p));
  const float scale = dropout_scale(p);
  for (int64_t i = e0; i < e1; ++i) {
    const bool keep = mask.keep(offset + static_cast<uint64_t>(i));
    from_float(keep ? to_float(x[i]) * scale : 0.f, out + i);
  }
}

template <class T>
void smax_fwd(const T* scores, const float* mask, T* probs, float scale, const SoftmaxShape& s,
              int64_t r0, int64_t r1) {
  const int64_t n = s.sk;
  std::vector<float> row(n);
  for (int64_t r = r0; r < r1; ++r) {
    load_row(scores + r * n, row.data(), n);
    const int64_t b = r / s.rows_per_batch;
    const float* m = nullptr;
    if (mask != nullptr) m = mask + (b * s.mq + (s.mq > 1 ? r % s.sq : 0)) * n;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    float mx = neg_inf;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < n; ++j) {
      row[j] = row[j] * scale + (m != nullptr ? m[j] : 0.f);
      mx = row[j] > mx ? row[j] : mx;
    }
    softmax_row(row.data(), n, mx);
    store_row(row.data(), probs + r * n, n);
  }
}

template <class T>
void smax_bwd(const T* dprobs, const T* probs, T* dscores, float scale, int64_t n, int64_t r0,
              int64_t r1) {
  std::vector<float> d(n), pr(n);
  for (int64_t r = r0; r < r1; ++r) {
    load_row(dprobs + r * n, d.data(), n);
    load_row(probs + r * n, pr.data(), n);
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < n; ++j) dot += d[j] * pr[j];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) d[j] = scale * pr[j] * (d[j] - dot);
    store_row(d.data(), dscores + r * n, n);
  }
}

}  // namespace

#define DS_T(ptr) static_cast<const T*>(ptr)
#define DS_MT(ptr) static_cast<T*>(ptr)

void layer_norm_fwd(DType t, const void* x, const void* gamma, const void* beta, void* y,
                    float* mean, float* rstd, int64_t r0, int64_t r1, int64_t h, float eps) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    ln_fwd(DS_T(x), DS_T(gamma), DS_T(beta), DS_MT(y), mean, rstd, r0, r1, h, eps);
  });
}

void layer_norm_bwd(DType t, const void* dy, const void* src, bool src_is_output, const void* gamma,
                    const void* beta, const float* mean, const float* rstd, void* dx, float* dgamma,
                    float* dbeta, int64_t r0, int64_t r1, int64_t h) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    ln_bwd(DS_T(dy), DS_T(src), src_is_output, DS_T(gamma), DS_T(beta), mean, rstd, DS_MT(dx),
           dgamma, dbeta, r0, r1, h);
  });
}

void bias_gelu_fwd(DType t, const void* x, const void* bias, void* y, int64_t r0, int64_t r1,
                   int64_t n) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    gelu_fwd(DS_T(x), DS_T(bias), DS_MT(y), r0, r1, n);
  });
}

void bias_gelu_bwd(DType t, const void* dy, const void* x, const void* bias, void* dx, int64_t r0,
                   int64_t r1, int64_t n) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    gelu_bwd(DS_T(dy), DS_T(x), DS_T(bias), DS_MT(dx), r0, r1, n);
  });
}

void bias_dropout_residual_fwd(DType t, const void* x, const void* bias, const void* residual,
                               void* out, float p, uint64_t seed, uint64_t offset, int64_t r0,
                               int64_t r1, int64_t n) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    bias_drop_res(DS_T(x), DS_T(bias), DS_T(residual), DS_MT(out), p, seed, offset, r0, r1, n);
  });
}

void dropout_apply(DType t, const void* x, void* out, float p, uint64_t seed, uint64_t offset,
                   int64_t e0, int64_t e1) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    drop_apply(DS_T(x), DS_MT(out), p, seed, offset, e0, e1);
  });
}

void softmax_fwd(DType t, const void* scores, const float* mask, void* probs, float scale,
                 const SoftmaxShape& s, int64_t r0, int64_t r1) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    smax_fwd(DS_T(scores), mask, DS_MT(probs), scale, s, r0, r1);
  });
}

void softmax_bwd(DType t, const void* dprobs, const void* probs, void* dscores, float scale,
                 int64_t sk, int64_t r0, int64_t r1) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    smax_bwd(DS_T(dprobs), DS_T(probs), DS_MT(dscores), scale, sk, r0, r1);
  });
}

#undef DS_T
#undef DS_MT

}  // namespace ds
