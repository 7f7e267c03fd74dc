"""`from deepspeed.pt_model import DeepSpeedModel` (the call some guides use)."""

from deepspeed_ext.runtime.initialize import DeepSpeedModel

__all__ = ["DeepSpeedModel"]
