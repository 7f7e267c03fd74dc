// Torch-free element types and dispatch for the CPU kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace ds {

enum class DType : int8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// 16-bit storage types; arithmetic always happens in fp32.
struct bf16_t {
  uint16_t x;
};
struct fp16_t {
  uint16_t x;
};

inline size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "?";
}

template <class T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) with T the storage type of `t`.
template <class F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: f(Tag<float>{}); break;
    case DType::kBFloat16: f(Tag<bf16_t>{}); break;
    case DType::kFloat16: f(Tag<fp16_t>{}); break;
  }
}

// Optimizer dispatch: params P (any), grads G (any: e.g. bf16 grads of fp32 masters),
// states S in {float, P}. Returns false for any other combination (the binding reports it).
template <class F>
bool dispatch_param_grad_state(DType p, DType g, DType s, F&& f) {
  bool ok = false;
  dispatch_dtype(p, [&](auto pt) {
    using P = typename decltype(pt)::type;
    if (s != p && s != DType::kFloat32) return;
    ok = true;
    dispatch_dtype(g, [&](auto gt) {
      if (s == DType::kFloat32) {
        f(pt, gt, Tag<float>{});
      } else {
        f(pt, gt, Tag<P>{});
      }
    });
  });
  return ok;
}

}  // namespace ds
