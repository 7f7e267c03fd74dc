"""Byte-level Huffman coding for top-k gradient pairs on the CPU: torch.ops.ds_huffman.*"""

from .builder import CPUOpBuilder


class HuffmanBuilder(CPUOpBuilder):
    NAME = "huffman"
    SOURCES = ("huffman/huffman_core.cpp", "bindings/huffman.cpp")
    INCLUDES = (".",)
