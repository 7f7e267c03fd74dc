"""Sign packing for 1-bit communication on the CPU: torch.ops.ds_packbits.*"""

from .builder import CPUOpBuilder


class PackBitsBuilder(CPUOpBuilder):
    NAME = "packbits"
    SOURCES = ("packbits/packbits_core.cpp", "bindings/packbits.cpp")
    INCLUDES = ("includes", ".")
