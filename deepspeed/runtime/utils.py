"""`deepspeed.runtime.utils`: the helpers upstream code imports from here."""

from deepspeed_ext.runtime.dataloader import RepeatingLoader
from deepspeed_ext.runtime.memory_report import see_memory_usage
from deepspeed_ext.runtime.pipe.partition import partition_balanced
from deepspeed_ext.runtime.upstream_utils import (
    call_to_str,
    get_global_norm,
    is_invalid_grad_norm,
    move_to_device,
    set_random_seed,
)
from deepspeed_ext.utils.splits import partition_uniform, prefix_sum_inc

__all__ = [
    "RepeatingLoader",
    "call_to_str",
    "get_global_norm",
    "is_invalid_grad_norm",
    "move_to_device",
    "partition_balanced",
    "partition_uniform",
    "prefix_sum_inc",
    "see_memory_usage",
    "set_random_seed",
]
