"""`deepspeed.runtime.zero.offload_config`: the offload sections' models and device enum."""

from deepspeed_ext.config.enums import OffloadDeviceEnum
from deepspeed_ext.config.sections.offload import (
    OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig,
)
from deepspeed_ext.config.sections.offload import (
    OffloadParamConfig as DeepSpeedZeroOffloadParamConfig,
)
from deepspeed_ext.runtime.offload_states import OffloadStateTypeEnum

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
