"""upstream's deepspeed.checkpoint (accelerate imports deepspeed.checkpoint.utils)."""

from . import utils

__all__ = ["utils"]
