"""upstream's deepspeed.checkpoint.utils: re-exports deepspeed_ext."""

from deepspeed_ext.runtime.checkpoint.clone import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
