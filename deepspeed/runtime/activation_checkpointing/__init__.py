"""`deepspeed.runtime.activation_checkpointing`: upstream's package path."""

from . import checkpointing

__all__ = ["checkpointing"]
