"""Fused multi-tensor Lion for CUDA: torch.ops.ds_fused_lion.multi_tensor_lion."""

from __future__ import annotations

from .builder import CUDAOpBuilder


class FusedLionBuilder(CUDAOpBuilder):
    NAME = "fused_lion"
    SOURCES = ("fused_lion/fused_lion.cu", "bindings/fused_lion.cpp")
    INCLUDES = ("includes", ".")

    def nvcc_flags(self) -> list[str]:
        # Memory bound: fast math buys nothing and would cost parity with the reference
        return [f for f in super().nvcc_flags() if f != "--use_fast_math"]
