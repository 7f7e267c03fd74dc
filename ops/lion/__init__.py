from .cpu_lion import DeepSpeedCPULion
from .fused_lion import FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
