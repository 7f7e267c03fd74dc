"""Block-sparse attention's CPU kernels: torch.ops.ds_sparse_attention.*"""

from .builder import CPUOpBuilder


class SparseAttnBuilder(CPUOpBuilder):
    NAME = "sparse_attention"
    SOURCES = ("sparse_attention/sparse_attention_core.cpp", "bindings/sparse_attention.cpp")
    INCLUDES = ("includes", ".", "bindings")
