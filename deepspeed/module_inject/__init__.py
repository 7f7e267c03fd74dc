"""deepspeed.module_inject: AutoTP's training-mode switch and sliced layers
(deepspeed_ext/tp/, deepspeed_ext/runtime/tensor_parallel.py)."""

from deepspeed_ext.runtime.tensor_parallel import set_autotp_mode

from . import layers

__all__ = ["layers", "set_autotp_mode"]
