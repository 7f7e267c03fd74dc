"""The fused transformer layer's CUDA kernels: torch.ops.ds_transformer_cuda.*"""

from __future__ import annotations

from .builder import CUDAOpBuilder


class TransformerCudaBuilder(CUDAOpBuilder):
    NAME = "transformer_cuda"
    SOURCES = ("transformer/transformer.cu", "bindings/transformer_cuda.cpp")
    INCLUDES = ("includes", ".", "bindings")
