#include "packbits/packbits.h"

#include <array>
#include <cmath>

#include "simd.h"

namespace ds {

namespace {

// byte -> the 8 signs it encodes, as +-1 floats
struct SignTable {
  std::array<std::array<float, 8>, 256> v;
  SignTable() {
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) v[b][j] = (b >> j) & 1 ? 1.f : -1.f;
  }
};
const SignTable kSigns;

template <class T, class Ops>
typename Ops::V load_y(const T* x, const float* err, int64_t i) {
  auto v = Ops::load(x + i);
  return err ? Ops::add(v, Ops::load(err + i)) : v;
}

}  // namespace

double sum_squares(DType t, const void* x, const float* err, int64_t n) {
  double total = 0.0;
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = static_cast<const T*>(x);
    constexpr int64_t kBlock = 4096;  // fp32 partial sums per block, blocks summed in double
    int64_t i = 0;
    for (; i < n; i += kBlock) {
      const int64_t end = i + kBlock < n ? i + kBlock : n;
      int64_t j = i;
      float part = 0.f;
      if constexpr (VecOps::kWidth > 1) {
        auto acc = VecOps::set1(0.f);
        for (; j + VecOps::kWidth <= end; j += VecOps::kWidth) {
          const auto y = load_y<T, VecOps>(xp, err, j);
          acc = VecOps::fma(y, y, acc);
        }
        part = VecOps::hsum(acc);
      }
      for (; j < end; ++j) {
        const float y = load_y<T, ScalarOps>(xp, err, j);
        part += y * y;
      }
      total += part;
    }
  });
  return total;
}

void pack_signs(DType t, const void* x, float* err, float scale, uint8_t* bits, int64_t n) {
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = static_cast<const T*>(x);
    int64_t i = 0;
    if constexpr (VecOps::kWidth > 1) {
      constexpr int kBytes = VecOps::kWidth / 8;
      const auto neg_scale = VecOps::set1(-scale);
      for (; i + VecOps::kWidth <= n; i += VecOps::kWidth) {
        const auto y = load_y<T, VecOps>(xp, err, i);
        const uint32_t m = VecOps::nonneg_mask(y);
        for (int b = 0; b < kBytes; ++b) bits[i / 8 + b] = uint8_t(m >> (8 * b));
        if (err) VecOps::store(err + i, VecOps::fma(VecOps::sign_pm1(y), neg_scale, y));
      }
    }
    for (int64_t b = i / 8; b < (n + 7) / 8; ++b) bits[b] = 0;
    for (; i < n; ++i) {
      const float y = load_y<T, ScalarOps>(xp, err, i);
      bits[i / 8] |= uint8_t(ScalarOps::nonneg_mask(y) << (i % 8));
      if (err) err[i] = y - scale * ScalarOps::sign_pm1(y);
    }
  });
}

void unpack_signs(const uint8_t* bits, float scale, float* out, int64_t n, bool accumulate) {
  const int64_t full = n / 8;
  for (int64_t b = 0; b < full; ++b) {
    const float* s = kSigns.v[bits[b]].data();
    float* o = out + 8 * b;
    if (accumulate) {
      for (int j = 0; j < 8; ++j) o[j] += s[j] * scale;
    } else {
      for (int j = 0; j < 8; ++j) o[j] = s[j] * scale;
    }
  }
  for (int64_t i = 8 * full; i < n; ++i) {
    const float v = kSigns.v[bits[i / 8]][i % 8] * scale;
    out[i] = accumulate ? out[i] + v : v;
  }
}

void abs_sum_above(DType t, const void* x, const float* err, int64_t n, float cut, double* sum,
                   int64_t* count) {
  double total = 0.0;
  int64_t above = 0;
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = static_cast<const T*>(x);
    constexpr int64_t kBlock = 4096;  // fp32 partial sums per block, blocks summed in double
    for (int64_t i = 0; i < n; i += kBlock) {
      const int64_t end = i + kBlock < n ? i + kBlock : n;
      float part = 0.f;
      for (int64_t j = i; j < end; ++j) {
        const float a = std::fabs(load_y<T, ScalarOps>(xp, err, j));
        const bool in = a >= cut;
        part += in ? a : 0.f;
        above += in;
      }
      total += part;
    }
  });
  *sum = total;
  *count = above;
}

void pack_two_bits(DType t, const void* x, float* err, float cut, float lo, float hi,
                   uint8_t* signs, uint8_t* levels, int64_t n) {
  // |decoded| = mid + level * half (level = +-1), the formula unpack_two_bits uses
  const float mid = 0.5f * (hi + lo), half = 0.5f * (hi - lo);
  dispatch_dtype(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = static_cast<const T*>(x);
    int64_t i = 0;
    if constexpr (VecOps::kWidth > 1) {
      constexpr int kBytes = VecOps::kWidth / 8;
      const auto vcut = VecOps::set1(cut), vmid = VecOps::set1(mid), vhalf = VecOps::set1(half);
      for (; i + VecOps::kWidth <= n; i += VecOps::kWidth) {
        const auto y = load_y<T, VecOps>(xp, err, i);
        const auto d = VecOps::sub(VecOps::abs(y), vcut);  // >= 0: the high level
        const uint32_t s = VecOps::nonneg_mask(y), l = VecOps::nonneg_mask(d);
        for (int b = 0; b < kBytes; ++b) {
          signs[i / 8 + b] = uint8_t(s >> (8 * b));
          levels[i / 8 + b] = uint8_t(l >> (8 * b));
        }
        if (err) {
          const auto mag = VecOps::fma(VecOps::sign_pm1(d), vhalf, vmid);
          VecOps::store(err + i, VecOps::sub(y, VecOps::mul(VecOps::sign_pm1(y), mag)));
        }
      }
    }
    for (int64_t b = i / 8; b < (n + 7) / 8; ++b) signs[b] = levels[b] = 0;
    for (; i < n; ++i) {
      const float y = load_y<T, ScalarOps>(xp, err, i);
      const float d = std::fabs(y) - cut;
      signs[i / 8] |= uint8_t(ScalarOps::nonneg_mask(y) << (i % 8));
      levels[i / 8] |= uint8_t(ScalarOps::nonneg_mask(d) << (i % 8));
      if (err) err[i] = y - ScalarOps::sign_pm1(y) * (mid + ScalarOps::sign_pm1(d) * half);
    }
  });
}

void unpack_two_bits(const uint8_t* signs, const uint8_t* levels, float lo, float hi, float* out,
                     int64_t n, bool accumulate) {
  // |value| = mid + level * half with level = +-1 from the same table as the signs
  const float mid = 0.5f * (hi + lo), half = 0.5f * (hi - lo);
  const int64_t full = n / 8;
  for (int64_t b = 0; b < full; ++b) {
    const float* s = kSigns.v[signs[b]].data();
    const float* l = kSigns.v[levels[b]].data();
    float* o = out + 8 * b;
    if (accumulate) {
      for (int j = 0; j < 8; ++j) o[j] += s[j] * (mid + l[j] * half);
    } else {
      for (int j = 0; j < 8; ++j) o[j] = s[j] * (mid + l[j] * half);
    }
  }
  for (int64_t i = 8 * full; i < n; ++i) {
    const float v = kSigns.v[signs[i / 8]][i % 8] * (mid + kSigns.v[levels[i / 8]][i % 8] * half);
    out[i] = accumulate ? out[i] + v : v;
  }
}

}  // namespace ds
