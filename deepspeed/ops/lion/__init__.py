from deepspeed_ext.ops.lion import DeepSpeedCPULion, FusedLion

from . import cpu_lion, fused_lion

__all__ = ["DeepSpeedCPULion", "FusedLion", "cpu_lion", "fused_lion"]
