"""`deepspeed.moe`: upstream's import path for mixture-of-experts layers."""

from . import experts, layer, sharded_moe, utils

__all__ = ["experts", "layer", "sharded_moe", "utils"]
