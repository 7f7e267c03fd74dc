"""`deepspeed.runtime.zero`: upstream's import path."""

from deepspeed_ext.zero.stage3 import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
