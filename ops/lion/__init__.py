from .cpu_lion import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
