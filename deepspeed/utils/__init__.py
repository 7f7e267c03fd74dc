from deepspeed_ext.runtime.dataloader import RepeatingLoader
from deepspeed_ext.utils.logging import log_dist, logger
from deepspeed_ext.zero.fragments import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_optimizer_state,
)
from deepspeed_ext.zero.stage3 import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from deepspeed_ext.zero.stage3.on_device import OnDevice

__all__ = [
    "RepeatingLoader",
    "groups",
    "get_z3_leaf_modules",
    "OnDevice",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]

from . import groups  # noqa: E402 - upstream code reads deepspeed.utils.groups after import
