// torch binding of the Huffman coder ([Note: Huffman stream]): checks every input.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>

#include "huffman/huffman.h"

namespace {

void check_bytes(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", arg, " is on ", t.device(),
              "; Huffman coding runs on CPU tensors");
  TORCH_CHECK(t.scalar_type() == at::kByte, op, ": ", arg, " has dtype ", t.scalar_type(),
              "; expected uint8");
  TORCH_CHECK(t.dim() == 1, op, ": ", arg, " has ", t.dim(), " dimensions; expected 1");
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, " is not contiguous");
}

at::Tensor encode(const at::Tensor& data) {
  check_bytes(data, "huffman.encode", "data");
  const auto n = static_cast<size_t>(data.numel());
  at::Tensor out = at::empty({static_cast<int64_t>(ds::huffman_bound(n))}, data.options());
  const size_t used = ds::huffman_encode(data.data_ptr<uint8_t>(), n, out.data_ptr<uint8_t>());
  return out.narrow(0, 0, static_cast<int64_t>(used));
}

at::Tensor decode(const at::Tensor& stream) {
  constexpr const char* op = "huffman.decode";
  check_bytes(stream, op, "stream");
  const auto size = static_cast<size_t>(stream.numel());
  const uint8_t* s = stream.data_ptr<uint8_t>();
  uint64_t n = 0;
  std::string why;
  const size_t max_n = size > ds::kHuffmanHeader ? (size - ds::kHuffmanHeader) * 8 : 0;
  TORCH_CHECK(ds::huffman_decoded_size(s, size, max_n, &n, &why), op, ": ", why);
  at::Tensor out = at::empty({static_cast<int64_t>(n)}, stream.options());
  TORCH_CHECK(ds::huffman_decode(s, size, out.data_ptr<uint8_t>(), &why), op, ": ", why);
  return out;
}

}  // namespace

TORCH_LIBRARY(ds_huffman, m) {
  m.def("encode(Tensor data) -> Tensor", &encode);
  m.def("decode(Tensor stream) -> Tensor", &decode);
}
