"""`deepspeed.moe.experts`: upstream's import path for Experts."""

from deepspeed_ext.moe.layer import Experts

__all__ = ["Experts"]
