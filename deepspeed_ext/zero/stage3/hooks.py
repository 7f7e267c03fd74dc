"""Module hooks that gather a module's parameters around its forward and backward.

[Note: stage-3 hooks]
- forward pre-hook: gather the module's own parameters (a leaf module's: all of them, see
  leaf.py), marking them active; forward post-hook: unmark and release those no other open
  forward or gather uses. Persistent parameters are never released.
- before the module's backward (a hook on each output tensor's gradient, which fires before
  the module's grad_fn runs): gather them again, as autograd reads the saved parameters.
- after the module's backward (a hook on its inputs' gradients): release the frozen ones.
  Trainable ones are released by the reducer once their gradient is taken.
- `on_gather` lets the prefetcher and the order checker see each gather, in execution order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .gather import gather_params, release_params
from .leaf import is_leaf_module
from .param import is_zero_param


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors needing grad anywhere inside nested outputs (tuples, lists, dicts, dataclasses)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    seen = 0
    while stack and seen < 10_000:
        seen += 1
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif hasattr(x, "__dataclass_fields__"):
            stack.extend(getattr(x, f, None) for f in x.__dataclass_fields__)
    return out


class ModuleHooks:
    def __init__(
        self,
        root: torch.nn.Module,
        on_gather: Callable[[torch.nn.Module, list[Any]], None] | None = None,
    ) -> None:
        self.handles: list[Any] = []
        self.on_gather = on_gather
        self.params_of: dict[int, list[Any]] = {}
        self.names: dict[int, str] = {}
        self._register(root, "")

    def _register(self, module: torch.nn.Module, name: str) -> None:
        leaf = is_leaf_module(module)
        params = [p for p in module.parameters(recurse=leaf) if is_zero_param(p)]
        self.params_of[id(module)] = params
        self.names[id(module)] = name or type(module).__name__
        if params:
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward))
        if not leaf:  # a leaf's children run inside its gather
            for child_name, child in module.named_children():
                self._register(child, f"{name}.{child_name}" if name else child_name)

    def module_name(self, module: torch.nn.Module) -> str:
        return self.names.get(id(module), type(module).__name__)

    def _gather(self, module: torch.nn.Module, params: list[Any]) -> None:
        if self.on_gather is not None:
            self.on_gather(module, params)
        gather_params(params)

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        params = self.params_of[id(module)]
        for p in params:
            p.ds_active += 1
        self._gather(module, params)
        if torch.is_grad_enabled():
            frozen = [p for p in params if not p.requires_grad]
            if frozen:
                for t in _tensors(args):
                    t.register_hook(lambda g, frozen=frozen: self._release(frozen, g))

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        params = self.params_of[id(module)]
        for p in params:
            p.ds_active -= 1
        release_params(params)
        if torch.is_grad_enabled():
            fired = [False]

            def pre_backward(grad: torch.Tensor) -> torch.Tensor:
                if not fired[0]:
                    fired[0] = True
                    self._gather(module, params)
                return grad

            for t in _tensors(output):
                t.register_hook(pre_backward)

    @staticmethod
    def _release(params: list[Any], grad: torch.Tensor) -> torch.Tensor:
        release_params(params)
        return grad

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
