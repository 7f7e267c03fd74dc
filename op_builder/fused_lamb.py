"""Fused multi-tensor LAMB for CUDA: torch.ops.ds_fused_lamb.multi_tensor_lamb."""

from __future__ import annotations

from .builder import CUDAOpBuilder


class FusedLambBuilder(CUDAOpBuilder):
    NAME = "fused_lamb"
    SOURCES = ("fused_lamb/fused_lamb.cu", "bindings/fused_lamb.cpp")
    INCLUDES = ("includes", ".")

    def nvcc_flags(self) -> list[str]:
        # Precise sqrt and division, so the CUDA path matches the CPU path and the pinned
        # math ([Note: lamb math]); the kernel is memory bound either way.
        return [f for f in super().nvcc_flags() if f != "--use_fast_math"]
