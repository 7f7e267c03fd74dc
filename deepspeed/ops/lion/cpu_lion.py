from deepspeed_ext.ops.lion.cpu_lion import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
