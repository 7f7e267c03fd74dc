"""1-bit optimizers and compressed gradient exchange, above comm's compressed all-reduce."""

from .codec import PackBitsCodec

__all__ = ["PackBitsCodec"]
