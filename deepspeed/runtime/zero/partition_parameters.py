"""`deepspeed.runtime.zero.partition_parameters`: upstream's import path."""

from deepspeed_ext.accelerator import get_accelerator
from deepspeed_ext.zero.stage3 import (
    GatheredParameters,
    Init,
    OnDevice,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)
from deepspeed_ext.zero.stage3.init import (
    _orig_torch_arange,
    zero_wrapper_for_fp_tensor_constructor,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "OnDevice",
    "ZeroParamStatus",
    "ZeroParamType",
    "_orig_torch_arange",
    "get_accelerator",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
