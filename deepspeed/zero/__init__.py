"""`deepspeed.zero`: upstream's import path for ZeRO stage 3's user API."""

from deepspeed_ext.zero.stage3 import (
    GatheredParameters,
    Init,
    OnDevice,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
    unwrap_model_for_generation,
)
from deepspeed_ext.zero.tiling import TiledLinear, TiledLinearReturnBias

__all__ = [
    "GatheredParameters",
    "Init",
    "OnDevice",
    "TiledLinear",
    "TiledLinearReturnBias",
    "ZeroParamStatus",
    "ZeroParamType",
    "register_external_parameter",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
]
