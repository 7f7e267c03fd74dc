from deepspeed_ext.ops.adam import DeepSpeedCPUAdam, FusedAdam

from . import cpu_adam, fused_adam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "cpu_adam", "fused_adam"]
