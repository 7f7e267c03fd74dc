"""1-bit optimizers, over the compressed exchange (runtime/compression)."""

from __future__ import annotations

from .adam import OnebitAdam
from .lamb import OnebitLamb
from .zoadam import ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
