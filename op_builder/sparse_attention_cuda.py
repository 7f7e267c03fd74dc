"""Block-sparse attention's CUDA kernels: torch.ops.ds_sparse_attention_cuda.*"""

from __future__ import annotations

from .builder import CUDAOpBuilder


class SparseAttnCudaBuilder(CUDAOpBuilder):
    NAME = "sparse_attention_cuda"
    SOURCES = (
        "sparse_attention/sparse_attention.cu",
        "sparse_attention/sparse_flash.cu",
        "bindings/sparse_attention_cuda.cpp",
    )
    INCLUDES = ("includes", ".", "bindings")
