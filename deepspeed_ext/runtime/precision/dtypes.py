"""The config's dtype names (data_types.grad_accum_dtype, communication_data_type), and
fp16.auto_cast's cast of a forward's inputs."""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def config_dtype(name: object) -> torch.dtype:
    """torch's dtype for a config name such as "bf16"."""
    return DTYPES[str(name)]


def cast_half(inputs: Any) -> Any:
    """Floating-point tensors in (nested) lists, tuples and dicts cast to fp16; the rest as
    they are (fp16.auto_cast, as upstream's)."""
    if isinstance(inputs, (list, tuple)):
        items = [cast_half(v) for v in inputs]
        return type(inputs)(*items) if hasattr(inputs, "_fields") else type(inputs)(items)
    if isinstance(inputs, dict):
        return {k: cast_half(v) for k, v in inputs.items()}
    if torch.is_tensor(inputs) and inputs.is_floating_point():
        return inputs.half()
    return inputs
