from deepspeed_ext.ops.adam.fused_adam import FusedAdam

__all__ = ["FusedAdam"]
