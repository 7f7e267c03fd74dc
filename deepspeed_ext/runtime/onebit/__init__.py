"""1-bit optimizers and compressed gradient exchange, above comm's compressed all-reduce."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .adam import OnebitAdam
from .codec import PackBitsCodec
from .exchange import OneBitExchange


def compression_windows(optimizer: Any, strategy: Any) -> list[Callable[[], dict[str, float]]]:
    """The metrics line's wire bytes and compression ratio, from whichever 1-bit exchange
    runs: a 1-bit optimizer's, or gradient_compression's."""
    exchange = getattr(getattr(strategy, "grads", None), "exchange", None)
    out: list[Callable[[], dict[str, float]]] = []
    if isinstance(optimizer, OnebitAdam):
        out.append(lambda: optimizer.exchange.comm.take_window())
    if isinstance(exchange, OneBitExchange):
        out.append(exchange.comm.take_window)
    return out


__all__ = ["OneBitExchange", "OnebitAdam", "PackBitsCodec", "compression_windows"]
