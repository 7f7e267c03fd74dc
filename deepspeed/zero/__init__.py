"""`deepspeed.zero`: upstream's import path for ZeRO stage 3's user API."""

from deepspeed_ext.zero.stage3 import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "register_external_parameter",
    "unregister_external_parameter",
]
