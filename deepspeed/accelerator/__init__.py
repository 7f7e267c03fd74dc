from deepspeed_ext.accelerator import get_accelerator, set_accelerator

__all__ = ["get_accelerator", "set_accelerator"]
