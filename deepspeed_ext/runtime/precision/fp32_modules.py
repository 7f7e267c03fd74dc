"""fp16_override_modules: module types that compute in fp32 inside a 16-bit model.

Their parameters stay stored in the model's dtype (so every ZeRO layout keeps one dtype;
the fp32 masters hold the precise values); for their forward the inputs and their own
parameters are cast up to fp32 (the cast is differentiable: gradients reach the 16-bit
parameters as usual) and the outputs cast back. The parameters are swapped for the call
without a second module call, so ZeRO-3's hooks see the module once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils import stateless

from deepspeed_ext.utils.logging import logger

from .dtypes import cast_floating


def _fp32_forward(module: torch.nn.Module, model_dtype: torch.dtype) -> Any:
    forward = module.forward

    def run_in_fp32(*args: Any, **kwargs: Any) -> Any:
        own = {n: p.float() for n, p in module.named_parameters(recurse=False)}
        with stateless._reparametrize_module(module, own):
            up = torch.float32
            out = forward(*cast_floating(args, up), **cast_floating(kwargs, up))
        return cast_floating(out, model_dtype)

    return run_in_fp32


def compute_in_fp32(
    model: torch.nn.Module, type_names: Sequence[str], model_dtype: torch.dtype
) -> list[str]:
    """Wrap the forward of every submodule whose class (name or dotted path) is listed;
    returns their names. A listed type the model does not use is said once."""
    wanted = set(type_names)
    hits: list[str] = []
    used: set[str] = set()
    for name, m in model.named_modules():
        cls = type(m)
        match = {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"} & wanted
        if match:
            m.forward = _fp32_forward(m, model_dtype)
            hits.append(name)
            used |= match
    for missing in sorted(wanted - used):
        logger.warning(f"fp16_override_modules: no module of type {missing!r} in the model")
    return hits
