from deepspeed_ext.runtime.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
