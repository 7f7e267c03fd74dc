from deepspeed_ext.runtime.dataloader import RepeatingLoader
from deepspeed_ext.utils.logging import log_dist, logger
from deepspeed_ext.zero.stage3 import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

__all__ = [
    "RepeatingLoader",
    "groups",
    "get_z3_leaf_modules",
    "log_dist",
    "logger",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]

from . import groups  # noqa: E402 - upstream code reads deepspeed.utils.groups after import
