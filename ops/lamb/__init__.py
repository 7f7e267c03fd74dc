"""LAMB optimizer (upstream DeepSpeed's FusedLamb)."""

from .fused_lamb import FusedLamb

__all__ = ["FusedLamb"]
