"""The config's dtype names (data_types.grad_accum_dtype, communication_data_type), and
fp16.auto_cast's cast of a forward's inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def config_dtype(name: object) -> torch.dtype:
    """torch's dtype for a config name such as "bf16"."""
    return DTYPES[str(name)]


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in (nested) lists, tuples and mappings cast to `dtype`; the
    rest as they are. Containers keep their types (a namedtuple, an OrderedDict, a Hugging
    Face BatchEncoding or ModelOutput), where they can be rebuilt from their items."""
    if isinstance(value, (list, tuple)):
        items = [cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, Mapping):
        cast = {k: cast_floating(v, dtype) for k, v in value.items()}
        try:
            return type(value)(cast)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return cast
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    return value


def cast_half(inputs: Any) -> Any:
    """fp16.auto_cast's cast of a forward's inputs, as upstream's (which turns a mapping
    into a plain dict or, not being a dict, leaves it uncast)."""
    return cast_floating(inputs, torch.float16)
