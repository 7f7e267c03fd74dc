"""The fused transformer layer's CPU kernels: torch.ops.ds_transformer.*"""

from .builder import CPUOpBuilder


class TransformerBuilder(CPUOpBuilder):
    NAME = "transformer"
    SOURCES = ("transformer/transformer_core.cpp", "bindings/transformer.cpp")
    INCLUDES = ("includes", ".", "bindings")
