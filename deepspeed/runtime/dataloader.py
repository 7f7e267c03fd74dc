"""`deepspeed.runtime.dataloader`: upstream's import path."""

from deepspeed_ext.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]
