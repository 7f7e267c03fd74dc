"""`deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam` (upstream's path)."""

from deepspeed_ext.runtime.onebit.zoadam import ZeroOneAdam

__all__ = ["ZeroOneAdam"]
