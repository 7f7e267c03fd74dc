from deepspeed_ext.ops.adam.cpu_adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
