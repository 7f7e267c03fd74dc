"""External parameters: a parameter of one module that another module's forward reads
(e.g. `F.linear(x, self.embed.weight)`), registered so it is gathered with that module."""

from __future__ import annotations

from typing import Any

import torch

from .param import is_zero_param


def register_external_parameter(module: torch.nn.Module, parameter: Any) -> None:
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter takes a Parameter, not {type(parameter)}")
    extra: list[Any] = module.__dict__.setdefault("_z3_external_params", [])
    if all(p is not parameter for p in extra):
        extra.append(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: Any) -> None:
    extra: list[Any] = module.__dict__.get("_z3_external_params", [])
    module.__dict__["_z3_external_params"] = [p for p in extra if p is not parameter]


def external_params(module: torch.nn.Module) -> list[Any]:
    return [p for p in module.__dict__.get("_z3_external_params", []) if is_zero_param(p)]
