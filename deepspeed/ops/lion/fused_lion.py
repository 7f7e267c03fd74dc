from deepspeed_ext.ops.lion.fused_lion import FusedLion

__all__ = ["FusedLion"]
