"""Fused multi-tensor Adam/AdamW for CUDA: torch.ops.ds_fused_adam.multi_tensor_adam."""

from __future__ import annotations

from .builder import CUDAOpBuilder


class FusedAdamBuilder(CUDAOpBuilder):
    NAME = "fused_adam"
    SOURCES = ("fused_adam/fused_adam.cu", "bindings/fused_adam.cpp")
    INCLUDES = ("includes", ".")

    def nvcc_flags(self) -> list[str]:
        # Precise sqrt and division: the kernel is memory bound, so fast math buys nothing
        # and would cost parity with torch.optim.
        return [f for f in super().nvcc_flags() if f != "--use_fast_math"]
