from deepspeed_ext.ops.lion import DeepSpeedCPULion

from . import cpu_lion

__all__ = ["DeepSpeedCPULion", "cpu_lion"]
