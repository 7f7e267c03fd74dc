// Splits many tensors into equal-sized chunks so one parallel loop balances them all.
#pragma once

#include <cstdint>
#include <vector>

namespace ds {

struct Chunk {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

// 16K elements: the four fp32 streams of an Adam chunk (256 KB) stay within L2.
constexpr int64_t kChunkElems = 16384;

inline std::vector<Chunk> make_chunks(const std::vector<int64_t>& numels,
                                      int64_t chunk = kChunkElems) {
  std::vector<Chunk> out;
  for (size_t t = 0; t < numels.size(); ++t) {
    for (int64_t b = 0; b < numels[t]; b += chunk) {
      const int64_t e = b + chunk < numels[t] ? b + chunk : numels[t];
      out.push_back({int32_t(t), b, e});
    }
  }
  return out;
}

}  // namespace ds
