"""`deepspeed.runtime.fp16.onebit`: the 1-bit optimizers under upstream's import path."""

from deepspeed_ext.runtime.onebit.adam import OnebitAdam
from deepspeed_ext.runtime.onebit.lamb import OnebitLamb
from deepspeed_ext.runtime.onebit.zoadam import ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
