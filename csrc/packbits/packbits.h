// Sign compression for 1-bit communication: torch-free core (CPU; packbits.cu for CUDA).
//
// [Note: sign packing]
// Element i of a tensor is bit (i % 8) of byte i / 8 (little-endian bit order), set when
// the value is >= 0: zero counts as positive, so every element decodes to +scale or -scale
// and a packed tensor of n elements takes ceil(n / 8) bytes. With error feedback the value
// compressed is y = x + err, and err becomes y - scale * sign(y): what this compression
// lost, added back before the next one.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace ds {

// sum over [0, n) of (x + err)^2, err optional (nullptr), accumulated in double
double sum_squares(DType t, const void* x, const float* err, int64_t n);

// bits of y = x + err over [0, n); n is a multiple of 8 except for a tensor's last piece
// (whose last byte's unused bits are 0). With err: err := y - scale * sign(y).
void pack_signs(DType t, const void* x, float* err, float scale, uint8_t* bits, int64_t n);

// out[i] = (accumulate ? out[i] : 0) + (bit i ? scale : -scale) over [0, n)
void unpack_signs(const uint8_t* bits, float scale, float* out, int64_t n, bool accumulate);

// [Note: two-bit packing]
// Two bit planes in the layout of [Note: sign packing]: the sign of y = x + err (set when
// y >= 0) and its level (set when |y| >= cut). A value decodes to +-hi or +-lo; with err,
// err := y - that. The gradient codec picks cut = mean |y|, hi and lo = the mean |y| at or
// above the cut and below it (abs_sum_above gives the sums and counts).

// sum and count of |x + err| over the elements whose |x + err| >= cut (cut < 0: all)
void abs_sum_above(DType t, const void* x, const float* err, int64_t n, float cut, double* sum,
                   int64_t* count);

// both planes of y = x + err over [0, n) (n a multiple of 8 except for a tensor's last piece)
void pack_two_bits(DType t, const void* x, float* err, float cut, float lo, float hi,
                   uint8_t* signs, uint8_t* levels, int64_t n);

// out[i] = (accumulate ? out[i] : 0) + (sign ? 1 : -1) * (level ? hi : lo) over [0, n)
void unpack_two_bits(const uint8_t* signs, const uint8_t* levels, float lo, float hi, float* out,
                     int64_t n, bool accumulate);

}  // namespace ds
