// Byte-level canonical Huffman coding: torch-free core (CPU).
//
// [Note: Huffman stream]
// A stream codes n bytes with one codebook of its own (built from those bytes' counts):
//   bytes 0..7     n, little-endian uint64
//   bytes 8..135   the code length of each byte value 0..255, 4 bits each (low nibble
//                  first); 0 = the value does not occur. Lengths are at most 15.
//   bytes 136..    the codes, most significant bit first, the last byte padded with 0s.
// Codes are canonical (assigned in order of (length, value)), so the lengths alone define
// the codebook. A stream whose only value occurs n times gives it length 1. Decoding checks
// everything a corrupt stream could break: the lengths form a prefix code (Kraft sum <= 1),
// every code read is in the book, and the bits suffice for n values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ds {

constexpr size_t kHuffmanHeader = 8 + 128;
constexpr int kHuffmanMaxLen = 15;

// the most bytes encode() writes for n input bytes
size_t huffman_bound(size_t n);

// codes data[0, n) into out (at least huffman_bound(n) bytes); returns the stream's size
size_t huffman_encode(const uint8_t* data, size_t n, uint8_t* out);

// the decoded size a stream declares; false (with why) if the stream is too short for its
// header or declares more than max_n bytes
bool huffman_decoded_size(const uint8_t* stream, size_t size, size_t max_n, uint64_t* n,
                          std::string* why);

// decodes a stream into out (decoded-size bytes); false (with why) if it is corrupt
bool huffman_decode(const uint8_t* stream, size_t size, uint8_t* out, std::string* why);

}  // namespace ds
