#!/usr/bin/env bash
# Compiles every .cu under csrc/ with nvcc (compile only) for sm_80 and sm_90, so the CUDA
# kernels cannot rot on machines without a GPU. Kernel cores are torch-free, so no torch
# headers are needed. The __CUDA_NO_*__ macros are the ones torch's extension build passes;
# defining them here catches implicit half/bf16 conversions that would break the JIT build.
set -euo pipefail

cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

FLAGS=(
  -std=c++17 -O3 -c -I csrc/includes
  -gencode arch=compute_80,code=sm_80
  -gencode arch=compute_90,code=sm_90
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
  -Xcompiler -Wall -Werror all-warnings
)

mapfile -t SOURCES < <(find csrc -name '*.cu' | sort)
if [ "${#SOURCES[@]}" -eq 0 ]; then
  echo "no .cu files under csrc/" >&2
  exit 1
fi

failed=0
for src in "${SOURCES[@]}"; do
  echo "nvcc: $src"
  obj="$OUT/$(echo "$src" | tr '/' '_').o"
  if ! "$NVCC" "${FLAGS[@]}" -I "$(dirname "$src")" "$src" -o "$obj"; then
    echo "FAILED: $src" >&2
    failed=1
  fi
done

# The torch-free C++ cores are C++17 too (the JIT build compiles them with torch's -std, and
# with -fopenmp, whose simd pragmas they use: -fopenmp-simd checks those here).
for src in $(find csrc -path csrc/bindings -prune -o -name '*.cpp' -print | sort); do
  echo "g++ -std=c++17: $src"
  g++ -std=c++17 -fopenmp-simd -fsyntax-only -Wall -Wextra -Werror -I csrc/includes -I csrc "$src" || {
    echo "FAILED: $src" >&2
    failed=1
  }
done

# The CUDA bindings see torch's headers: check they parse, when torch is installed. The CPU
# wheel lacks c10's generated cuda_cmake_macros.h; torch's opt-out macro stands in for it.
if TORCH_INC=$(python -c 'from torch.utils.cpp_extension import include_paths as p; print(" ".join("-I" + x for x in p()))' 2>/dev/null); then
  CUDA_INC="${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}/include"
  [ -f "$CUDA_INC/cuda_runtime.h" ] || CUDA_INC=$(dirname "$(ls /usr/local/cuda*/include/cuda_runtime.h 2>/dev/null | head -1)")
  for src in csrc/bindings/fused_*.cpp csrc/bindings/*_cuda.cpp; do
    echo "g++ -fsyntax-only (torch headers): $src"
    # shellcheck disable=SC2086
    g++ -std=c++20 -fsyntax-only -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE $TORCH_INC -I "$CUDA_INC" \
      -I csrc/includes -I csrc "$src" || {
      echo "FAILED: $src" >&2
      failed=1
    }
  done
fi

if [ "$failed" -ne 0 ]; then
  echo "CUDA compile check failed" >&2
  exit 1
fi
echo "all ${#SOURCES[@]} CUDA sources compiled; C++ cores and CUDA bindings checked"
