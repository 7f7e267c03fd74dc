"""Byte-level canonical Huffman coding ([Note: Huffman stream] in csrc/huffman): `encode`
gives a self-describing stream (its codebook built from the data's own byte counts),
`decode` checks it and gives the bytes back. CPU tensors; a stream is plain uint8, so it
travels as any tensor does."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.op_builder.huffman import HuffmanBuilder

_op: Any = None


def op() -> Any:
    global _op
    if _op is None:
        _op = HuffmanBuilder().load()
    return _op


def encode(data: torch.Tensor) -> torch.Tensor:
    """uint8 [n] -> a uint8 stream (header with the code lengths, then the codes)."""
    return op().encode(data)


def decode(stream: torch.Tensor) -> torch.Tensor:
    """A stream from encode() -> its uint8 bytes; a corrupt stream raises, naming why."""
    return op().decode(stream)


__all__ = ["decode", "encode", "op"]
