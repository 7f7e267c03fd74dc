"""`deepspeed.runtime.fp16.onebit.lamb.OnebitLamb` (upstream's path)."""

from deepspeed_ext.runtime.onebit.lamb import OnebitLamb

__all__ = ["OnebitLamb"]
