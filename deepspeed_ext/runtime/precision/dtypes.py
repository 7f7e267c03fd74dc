"""The config's dtype names (data_types.grad_accum_dtype, communication_data_type)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def config_dtype(name: object) -> torch.dtype:
    """torch's dtype for a config name such as "bf16"."""
    return DTYPES[str(name)]
