#include "huffman/huffman.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <queue>
#include <vector>

namespace ds {

namespace {

using Lengths = std::array<uint8_t, 256>;

// Huffman code lengths of the values that occur; an over-long code (> 15) halves the
// counts (keeping every count >= 1) and builds again: close to optimal, and rare.
Lengths code_lengths(std::array<uint64_t, 256> counts) {
  Lengths len{};
  int used = 0;
  for (uint64_t c : counts) used += c > 0;
  if (used == 1) {  // a lone value still needs one bit per occurrence
    for (int v = 0; v < 256; ++v) len[v] = counts[v] > 0;
    return len;
  }
  while (true) {
    // nodes 0..255 are leaves, then internal nodes; parent[] walks leaves to the root
    std::vector<int> parent(512, -1);
    using Node = std::pair<uint64_t, int>;  // (weight, id); ties broken by id: deterministic
    std::priority_queue<Node, std::vector<Node>, std::greater<Node>> heap;
    for (int v = 0; v < 256; ++v)
      if (counts[v]) heap.push({counts[v], v});
    int next = 256;
    while (heap.size() > 1) {
      const Node a = heap.top();
      heap.pop();
      const Node b = heap.top();
      heap.pop();
      parent[a.second] = parent[b.second] = next;
      heap.push({a.first + b.first, next++});
    }
    int longest = 0;
    for (int v = 0; v < 256; ++v) {
      if (!counts[v]) continue;
      int d = 0;
      for (int at = v; parent[at] >= 0; at = parent[at]) ++d;
      len[v] = static_cast<uint8_t>(std::min(d, 255));
      longest = std::max(longest, d);
    }
    if (longest <= kHuffmanMaxLen) return len;
    for (auto& c : counts)
      if (c) c = (c >> 1) | 1;
  }
}

// canonical codes from lengths: shorter first, equal lengths in value order
std::array<uint32_t, 256> canonical(const Lengths& len) {
  std::array<int, kHuffmanMaxLen + 2> per_len{};
  for (uint8_t l : len) ++per_len[l];
  per_len[0] = 0;
  std::array<uint32_t, kHuffmanMaxLen + 2> first{};
  uint32_t code = 0;
  for (int l = 1; l <= kHuffmanMaxLen; ++l) {
    code = (code + per_len[l - 1]) << 1;
    first[l] = code;
  }
  std::array<uint32_t, 256> codes{};
  for (int v = 0; v < 256; ++v)
    if (len[v]) codes[v] = first[len[v]]++;
  return codes;
}

void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

size_t huffman_bound(size_t n) { return kHuffmanHeader + (n * kHuffmanMaxLen + 7) / 8 + 8; }

size_t huffman_encode(const uint8_t* data, size_t n, uint8_t* out) {
  std::array<uint64_t, 256> counts{};
  for (size_t i = 0; i < n; ++i) ++counts[data[i]];
  const Lengths len = code_lengths(counts);
  const auto codes = canonical(len);
  put_u64(out, n);
  for (int v = 0; v < 256; v += 2) out[8 + v / 2] = static_cast<uint8_t>(len[v] | len[v + 1] << 4);
  uint8_t* w = out + kHuffmanHeader;
  uint64_t acc = 0;  // pending bits, most significant first, `have` of them
  int have = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t v = data[i];
    acc = acc << len[v] | codes[v];
    have += len[v];
    while (have >= 8) {
      have -= 8;
      *w++ = static_cast<uint8_t>(acc >> have);
    }
  }
  if (have > 0) *w++ = static_cast<uint8_t>(acc << (8 - have));
  return static_cast<size_t>(w - out);
}

bool huffman_decoded_size(const uint8_t* stream, size_t size, size_t max_n, uint64_t* n,
                          std::string* why) {
  if (size < kHuffmanHeader) {
    *why = "the stream has " + std::to_string(size) + " bytes, fewer than its " +
           std::to_string(kHuffmanHeader) + "-byte header";
    return false;
  }
  *n = get_u64(stream);
  if (*n > max_n) {
    *why = "the stream declares " + std::to_string(*n) + " bytes, more than its " +
           std::to_string(size - kHuffmanHeader) + " bytes of codes can hold";
    return false;
  }
  return true;
}

bool huffman_decode(const uint8_t* stream, size_t size, uint8_t* out, std::string* why) {
  uint64_t n = 0;
  // each value takes at least one bit
  if (!huffman_decoded_size(stream, size, (size - std::min(size, kHuffmanHeader)) * 8, &n, why))
    return false;
  Lengths len{};
  for (int v = 0; v < 256; v += 2) {
    len[v] = stream[8 + v / 2] & 15;
    len[v + 1] = stream[8 + v / 2] >> 4;
  }
  uint64_t kraft = 0;  // sum of 2^(15 - len): a prefix code keeps it <= 2^15
  for (uint8_t l : len)
    if (l) kraft += 1u << (kHuffmanMaxLen - l);
  if (kraft > (1u << kHuffmanMaxLen)) {
    *why = "its code lengths do not form a prefix code (corrupt header)";
    return false;
  }
  if (n > 0 && kraft == 0) {
    *why = "it declares " + std::to_string(n) + " bytes but no code";
    return false;
  }
  // every 15-bit window -> (value, length) of the code it starts with; 0 length: no code
  const auto codes = canonical(len);
  std::vector<uint16_t> table(1u << kHuffmanMaxLen, 0);
  for (int v = 0; v < 256; ++v) {
    if (!len[v]) continue;
    const int free_bits = kHuffmanMaxLen - len[v];
    const uint32_t base = codes[v] << free_bits;
    for (uint32_t k = 0; k < (1u << free_bits); ++k)
      table[base + k] = static_cast<uint16_t>(v | len[v] << 8);
  }
  const uint8_t* r = stream + kHuffmanHeader;
  const uint8_t* end = stream + size;
  const uint64_t total_bits = static_cast<uint64_t>(end - r) * 8;
  uint64_t acc = 0, used = 0;  // bits consumed so far
  int have = 0;
  for (uint64_t i = 0; i < n; ++i) {
    while (have < kHuffmanMaxLen) {  // past the end reads zeros; `used` catches overruns
      acc = acc << 8 | (r < end ? *r++ : 0);
      have += 8;
    }
    const uint16_t e = table[(acc >> (have - kHuffmanMaxLen)) & ((1u << kHuffmanMaxLen) - 1)];
    const int l = e >> 8;
    if (l == 0) {
      *why = "value " + std::to_string(i) + " has a code that is not in the book";
      return false;
    }
    used += l;
    if (used > total_bits) {
      *why = "the codes end after " + std::to_string(i) + " of " + std::to_string(n) + " values";
      return false;
    }
    out[i] = static_cast<uint8_t>(e & 255);
    have -= l;
  }
  return true;
}

}  // namespace ds
