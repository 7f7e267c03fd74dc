"""`deepspeed.moe.layer`: upstream's import path for the MoE layer."""

from deepspeed_ext.moe.layer import MoE

__all__ = ["MoE"]
