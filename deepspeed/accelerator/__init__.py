from deepspeed_ext.accelerator import (
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = ["get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
