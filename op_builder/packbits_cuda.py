"""Sign packing for 1-bit communication on CUDA: torch.ops.ds_packbits_cuda.*"""

from __future__ import annotations

from .builder import CUDAOpBuilder


class PackBitsCudaBuilder(CUDAOpBuilder):
    NAME = "packbits_cuda"
    SOURCES = ("packbits/packbits.cu", "bindings/packbits_cuda.cpp")
    INCLUDES = ("includes", ".", "packbits")
