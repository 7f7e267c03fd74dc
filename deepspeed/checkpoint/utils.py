"""upstream's deepspeed.checkpoint.utils: re-exports deepspeed_ext."""

from deepspeed_ext.runtime.checkpoint.clone import clone_tensors_for_torch_save
from deepspeed_ext.runtime.checkpoint.layout import (
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)

__all__ = [
    "clone_tensors_for_torch_save",
    "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
]
