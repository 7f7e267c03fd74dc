// Scalar fp16 / bf16 <-> fp32 conversion with round-to-nearest-even, as the vector paths do,
// so the tail elements of a tensor round exactly like its body.
#pragma once

#include <cstdint>
#include <cstring>

#include "dtype.h"

namespace ds {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16_t h) { return bits_to_float(uint32_t(h.x) << 16); }
inline float to_float(fp16_t h) {
  const uint32_t sign = uint32_t(h.x & 0x8000) << 16;
  const uint32_t exp = (h.x >> 10) & 0x1f;
  uint32_t mant = h.x & 0x3ff;
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return bits_to_float(sign);
  // Subnormal: shift the leading one up to the implicit bit, lowering the exponent.
  int shifts = 0;
  while (!(mant & 0x400)) {
    mant <<= 1;
    ++shifts;
  }
  return bits_to_float(sign | uint32_t(113 - shifts) << 23 | ((mant & 0x3ff) << 13));
}

inline void from_float(float v, float* out) { *out = v; }
inline void from_float(float v, bf16_t* out) {
  uint32_t u = float_to_bits(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
    out->x = uint16_t((u >> 16) | 0x40);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  out->x = uint16_t(u >> 16);
}
inline void from_float(float v, fp16_t* out) {
  const uint32_t u = float_to_bits(v);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf or NaN
    out->x = sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0);
  } else if (a >= 0x477ff000u) {  // >= 65520 rounds past the largest half
    out->x = sign | 0x7c00;
  } else if (a < 0x38800000u) {  // below 2^-14: subnormal half
    // Adding 0.5f puts the value's 2^-24 units in the low mantissa bits, rounded RNE by the FPU.
    const float shifted = bits_to_float(a) + 0.5f;
    out->x = sign | uint16_t(float_to_bits(shifted) - 0x3f000000u);
  } else {
    a += 0xc8000fffu + ((a >> 13) & 1u);  // rebias exponent by -112, round to nearest even
    out->x = sign | uint16_t(a >> 13);
  }
}

}  // namespace ds
