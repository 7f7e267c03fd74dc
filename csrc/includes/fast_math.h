// exp and tanh in straight-line float arithmetic, for kernels whose loops must vectorize.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace ds {

// exp(x) in straight-line float/int arithmetic, so loops that call it vectorize (std::exp is
// a scalar library call): x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for exactness),
// e^r by a degree-6 polynomial (Cephes' expf coefficients, relative error ~1e-7), times 2^n
// built in the exponent bits. Below -87.3 (2^-126) it returns 0, as a masked score should.
inline float fast_exp(float x) {
  const bool zero = x < -87.3f;
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  // round to nearest by the 1.5 * 2^23 trick (std::floor blocks vectorization)
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  q = q * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return zero ? 0.f : q * scale;
}

// tanh(z) = 1 - 2 / (e^{2z} + 1): exact at both tails (e^{2z} saturates), absolute error
// ~1e-7 near 0, which is all GeLU's 0.5 u (1 + tanh) needs.
inline float fast_tanh(float z) { return 1.f - 2.f / (fast_exp(2.f * z) + 1.f); }

// v[0..n) <- softmax(v), given mx = max(v) over its non-NaN entries. A row holding a NaN
// becomes NaN, as torch's softmax makes it (a max skips NaN, and fast_exp does not carry it:
// a diverged score would otherwise vanish into zeros). A row of -inf only (every entry masked
// out) becomes zeros, not NaN: it attends to nothing.
inline void softmax_row(float* v, int64_t n, float mx) {
  bool nan = false;
#pragma omp simd reduction(| : nan)
  for (int64_t j = 0; j < n; ++j) nan |= v[j] != v[j];
  if (nan) {
    for (int64_t j = 0; j < n; ++j) v[j] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  if (mx == -std::numeric_limits<float>::infinity()) {
    for (int64_t j = 0; j < n; ++j) v[j] = 0.f;
    return;
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    v[j] = fast_exp(v[j] - mx);
    sum += v[j];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) v[j] *= inv;
}

}  // namespace ds
