"""`deepspeed.runtime.fp16.onebit.adam.OnebitAdam` (upstream's path)."""

from deepspeed_ext.runtime.onebit.adam import OnebitAdam

__all__ = ["OnebitAdam"]
