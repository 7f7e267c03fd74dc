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


def cast_half(inputs: Any) -> Any:
    """Floating-point tensors in (nested) lists, tuples and mappings cast to fp16; the rest
    as they are (fp16.auto_cast, as upstream's; a mapping keeps its type, where upstream's
    becomes a plain dict or, not being a dict, stays uncast)."""
    if isinstance(inputs, (list, tuple)):
        items = [cast_half(v) for v in inputs]
        return type(inputs)(*items) if hasattr(inputs, "_fields") else type(inputs)(items)
    if isinstance(inputs, Mapping):  # OrderedDict, a Hugging Face BatchEncoding: their type
        cast = {k: cast_half(v) for k, v in inputs.items()}
        try:
            return type(inputs)(cast)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return cast
    if torch.is_tensor(inputs) and inputs.is_floating_point():
        return inputs.half()
    return inputs
