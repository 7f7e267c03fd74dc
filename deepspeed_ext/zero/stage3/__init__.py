"""ZeRO stage 3: partitioned parameters gathered around each module's use (one concept per
file: param, gather, reduce, hooks, leaf, strategy, init, gathered)."""

from .external import register_external_parameter, unregister_external_parameter
from .gathered import GatheredParameters
from .init import Init
from .leaf import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from .param import ZeroParamStatus, is_zero_param
from .strategy import Stage3Options, Stage3Strategy

__all__ = [
    "GatheredParameters",
    "Init",
    "Stage3Options",
    "Stage3Strategy",
    "ZeroParamStatus",
    "get_z3_leaf_modules",
    "is_zero_param",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "unregister_external_parameter",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
