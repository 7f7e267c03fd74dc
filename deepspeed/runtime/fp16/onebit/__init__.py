"""`deepspeed.runtime.fp16.onebit`: 1-bit Adam under upstream's import path."""

from deepspeed_ext.runtime.onebit.adam import OnebitAdam

__all__ = ["OnebitAdam"]
