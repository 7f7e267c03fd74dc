"""ZeRO stage 3: partitioned parameters gathered around each module's use (one concept per
file: param, gather, reduce, hooks, leaf, strategy, init, gathered)."""

from .external import register_external_parameter, unregister_external_parameter
from .gathered import GatheredParameters
from .generation import unwrap_model_for_generation
from .init import Init
from .leaf import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from .on_device import OnDevice
from .param import ZeroParamStatus, ZeroParamType, is_zero_param
from .strategy import Stage3Options, Stage3Strategy

__all__ = [
    "GatheredParameters",
    "Init",
    "OnDevice",
    "Stage3Options",
    "Stage3Strategy",
    "ZeroParamStatus",
    "ZeroParamType",
    "get_z3_leaf_modules",
    "is_zero_param",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "unregister_external_parameter",
    "unset_z3_leaf_modules",
    "unwrap_model_for_generation",
    "z3_leaf_module",
]
