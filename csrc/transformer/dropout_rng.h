// Counter-based dropout masks ([Note: replayed dropout]).
//
// Element i of a dropout call keeps its value when its 16 random bits clear the drop threshold.
// The bits are a pure function of (seed, offset + i): backward (and a checkpointed recompute)
// regenerates the mask instead of storing it, and CPU and CUDA kernels draw the same mask for
// the same call. The generator is splitmix64 keyed by the seed: one 64-bit draw,
// mix64(key + g * gamma), serves the four elements of group g = index / 4, 16 bits each
// (index % 4 picks which). One draw per four elements keeps the GPU kernels memory-bound: a
// 64-bit multiply is several instructions there. 16 bits quantize p to 1/65536.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DS_HD __host__ __device__ __forceinline__
#else
#define DS_HD inline
#endif

namespace ds {

constexpr uint64_t kSplitmixGamma = 0x9e3779b97f4a7c15ull;

DS_HD uint64_t mix64(uint64_t z) {
  z += kSplitmixGamma;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// p in [0, 1] -> the 16-bit threshold below which an element is dropped (65536: all dropped).
DS_HD uint32_t drop_threshold(float p) {
  return p <= 0.f ? 0u : (p >= 1.f ? (1u << 16) : static_cast<uint32_t>(p * 65536.f + 0.5f));
}

// The factor a kept element is multiplied by (0 when everything is dropped).
DS_HD float dropout_scale(float p) { return p >= 1.f ? 0.f : 1.f / (1.f - p); }

// The keep decisions of one call, element by element in index order: a new draw only when the
// index enters another group of four.
class DropoutMask {
 public:
  DS_HD DropoutMask(uint64_t seed, uint32_t threshold) : key_(mix64(seed)), thr_(threshold) {}

  DS_HD bool keep(uint64_t index) {
    const uint64_t g = index >> 2;
    if (g != group_ || !drawn_) {
      bits_ = mix64(key_ + g * kSplitmixGamma);
      group_ = g;
      drawn_ = true;
    }
    return static_cast<uint32_t>((bits_ >> ((index & 3u) * 16u)) & 0xffffu) >= thr_;
  }

 private:
  uint64_t key_;
  uint32_t thr_;
  uint64_t group_ = 0, bits_ = 0;
  bool drawn_ = false;
};

}  // namespace ds
