// Counter-based dropout masks ([Note: replayed dropout]).
//
// Element i of a dropout call keeps its value when hash(seed, offset + i) clears the drop
// threshold. The mask is a pure function of (seed, offset, i): backward (and a checkpointed
// recompute) regenerates it instead of storing it, and CPU and CUDA kernels draw the same mask
// for the same call. The hash is splitmix64's finalizer applied twice; 24 uniform bits decide.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DS_HD __host__ __device__ __forceinline__
#else
#define DS_HD inline
#endif

namespace ds {

DS_HD uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// p in [0, 1] -> the 24-bit threshold below which an element is dropped.
DS_HD uint32_t drop_threshold(float p) {
  return p <= 0.f ? 0u : (p >= 1.f ? (1u << 24) : static_cast<uint32_t>(p * 16777216.f + 0.5f));
}

DS_HD bool dropout_keep(uint64_t seed, uint64_t index, uint32_t threshold) {
  return static_cast<uint32_t>(mix64(seed ^ mix64(index)) >> 40) >= threshold;
}

// The factor a kept element is multiplied by (0 when everything is dropped).
DS_HD float dropout_scale(float p) { return p >= 1.f ? 0.f : 1.f / (1.f - p); }

}  // namespace ds
