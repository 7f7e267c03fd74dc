"""Compressed data-parallel exchange: the codecs ([Note: gradient codecs]), the Huffman row
coder, and the exchange with its error buffers, over comm's compressed mean."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .codecs import SignCodec, TopKCodec, TwoBitCodec, codec_for
from .exchange import CompressedExchange
from .rows import HuffmanRows


def gradient_exchange(section: Any, group: Any) -> CompressedExchange | None:
    """The `gradient_compression` section's exchange over the data-parallel group (None:
    the section is absent)."""
    if section is None:
        return None
    codec = codec_for(section.algorithm, section.topk_ratio)
    return CompressedExchange(codec, group, HuffmanRows() if section.huffman_coding else None)


def compression_windows(*owners: Any) -> list[Callable[[], dict[str, float]]]:
    """The metrics line's wire bytes and compression ratio, from whichever compressed
    exchange runs: a 1-bit optimizer's (its `exchange`), or gradient_compression's."""
    out = []
    for owner in owners:
        ex = owner if isinstance(owner, CompressedExchange) else getattr(owner, "exchange", None)
        if isinstance(ex, CompressedExchange):
            out.append(ex.comm.take_window)
    return out


__all__ = [
    "compression_windows",
    "CompressedExchange",
    "HuffmanRows",
    "SignCodec",
    "TopKCodec",
    "TwoBitCodec",
    "codec_for",
    "gradient_exchange",
]
