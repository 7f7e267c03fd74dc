"""`deepspeed.runtime.config`: upstream's config object."""

from deepspeed_ext.runtime.ds_config import DeepSpeedConfig

__all__ = ["DeepSpeedConfig"]
