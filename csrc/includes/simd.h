// One vector abstraction for the CPU kernels: AVX-512, AVX2 or scalar, chosen by the
// compiler flags the op builder passes (-mavx512f..., -mavx2 -mfma -mf16c, or none).
//
// [Note: simd ops]
// Kernels are written once against an ops struct (VecOps or ScalarOps) with the same
// static functions; the body of a tensor runs VecOps, its tail ScalarOps, and both round
// 16-bit stores to nearest even, so a tail element ends exactly like a body element would
// (up to FMA contraction).
#pragma once

#include <cmath>
#include <cstdint>

#include "half.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ds {

struct ScalarOps {
  using V = float;
  static constexpr int kWidth = 1;
  static V set1(float x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }  // a*b+c
  static V sqrt(V a) { return std::sqrt(a); }
  static V abs(V a) { return std::fabs(a); }
  static V sign(V a) { return a > 0.f ? 1.f : (a < 0.f ? -1.f : 0.f); }
  // [Note: sign packing] (packbits/packbits.h): lane j of the mask is bit j, set for a >= 0
  static uint32_t nonneg_mask(V a) { return a >= 0.f ? 1u : 0u; }
  static V sign_pm1(V a) { return a >= 0.f ? 1.f : -1.f; }  // zero counts as +1
  static float hsum(V a) { return a; }
  template <class T>
  static V load(const T* p) {
    return to_float(*p);
  }
  template <class T>
  static void store(T* p, V v) {
    from_float(v, p);
  }
};

#if defined(__AVX512F__)

constexpr const char* kSimdName = "avx512";
struct VecOps {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V abs(V a) { return _mm512_abs_ps(a); }
  static V sign(V a) {
    const __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __mmask16 neg = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
    V r = _mm512_mask_mov_ps(_mm512_setzero_ps(), pos, _mm512_set1_ps(1.f));
    return _mm512_mask_mov_ps(r, neg, _mm512_set1_ps(-1.f));
  }
  static uint32_t nonneg_mask(V a) {
    return _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ);
  }
  static V sign_pm1(V a) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(-1.f), nonneg_mask(a), _mm512_set1_ps(1.f));
  }
  static float hsum(V a) { return _mm512_reduce_add_ps(a); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const bf16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load(const fp16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store(bf16_t* p, V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan,
                              _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store(fp16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

#elif defined(__AVX2__)

constexpr const char* kSimdName = "avx2";
struct VecOps {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V abs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  static V sign(V a) {
    const V zero = _mm256_setzero_ps();
    const V pos = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), _mm256_set1_ps(1.f));
    const V neg = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.f));
    return _mm256_or_ps(pos, neg);
  }
  static uint32_t nonneg_mask(V a) {
    return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GE_OQ)));
  }
  static V sign_pm1(V a) {
    return _mm256_blendv_ps(_mm256_set1_ps(-1.f), _mm256_set1_ps(1.f),
                            _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GE_OQ));
  }
  static float hsum(V a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load(const fp16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store(bf16_t* p, V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, quiet, nan);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store(fp16_t* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

#else

constexpr const char* kSimdName = "scalar";
using VecOps = ScalarOps;

#endif

// Runs lane(Ops, offset) over [0, n): vector body, scalar tail.
template <class Lane>
inline void for_each_lane(int64_t n, Lane&& lane) {
  int64_t i = 0;
  if constexpr (VecOps::kWidth > 1) {
    for (; i + VecOps::kWidth <= n; i += VecOps::kWidth) lane(VecOps{}, i);
  }
  for (; i < n; ++i) lane(ScalarOps{}, i);
}

}  // namespace ds
