"""`deepspeed.runtime.zero.config`: the zero_optimization section's model and stage enum."""

from deepspeed_ext.config.enums import ZeroStageEnum
from deepspeed_ext.config.sections.zero import ZeroConfig as DeepSpeedZeroConfig

__all__ = ["DeepSpeedZeroConfig", "ZeroStageEnum"]
