from deepspeed_ext.ops.adagrad import DeepSpeedCPUAdagrad

from . import cpu_adagrad

__all__ = ["DeepSpeedCPUAdagrad", "cpu_adagrad"]
