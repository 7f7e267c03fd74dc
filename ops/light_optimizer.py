"""LightOptimizer: torch.optim.Optimizer without the torch._dynamo import.

[Note: optimizers without dynamo]
torch.optim.Optimizer's add_param_group, state_dict, load_state_dict and zero_grad are
wrapped in torch._disable_dynamo, which imports torch._dynamo on their first call: about
70 MB of resident memory in every rank process, for a job that never compiles. Our
optimizers call the unwrapped methods while torch._dynamo is not loaded; once it is
(torch.compile in use), they run as torch wraps them, so dynamo still never traces them.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _unwrapped(name: str) -> Any:
    fn = getattr(torch.optim.Optimizer, name)
    return getattr(fn, "__wrapped__", fn)


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


class LightOptimizer(torch.optim.Optimizer):
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if _dynamo_loaded():
            return super().add_param_group(param_group)
        return _unwrapped("add_param_group")(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        if _dynamo_loaded():
            return super().state_dict()
        return _unwrapped("state_dict")(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _dynamo_loaded():
            return super().load_state_dict(state_dict)
        return _unwrapped("load_state_dict")(self, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _dynamo_loaded():
            return super().zero_grad(set_to_none)
        return _unwrapped("zero_grad")(self, set_to_none)
