"""Module hooks that gather a module's parameters around its forward and backward.

[Note: stage-3 hooks]
- forward pre-hook: fetch the module's own parameters (a leaf module's: all of them, see
  leaf.py; plus registered external ones) through the coordinator, marking them active;
  forward post-hook: unmark and release those no open forward or gather uses, unless the
  coordinator expects them back soon. Persistent parameters are never released.
- before the module's backward (a hook on each output tensor's gradient, which fires before
  the module's grad_fn runs): fetch them again, as autograd reads the saved parameters.
- after the module's backward (a hook on its inputs' gradients): release the frozen ones.
  Trainable ones are released by the strategy once their gradient is taken.
- a parameter several modules own runs each use on its own alias ([Note: per-use aliases of
  tied parameters]), swapped in after the gather and back by an always-called forward hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .coordinator import BACKWARD, FORWARD, GatherCoordinator
from .external import external_params
from .gather import release_params
from .leaf import is_leaf_module
from .param import is_zero_param
from .tied import TiedAliases, tied_names


def _recomputing() -> bool:
    """[Note: recompute under stage 3]
    A forward that runs while autograd runs a backward is an activation checkpoint's
    recompute. Its gathers count as the backward's. The parameters stay gathered after it
    (the strategy releases each once its gradient is taken; a frozen one at the next
    forward's end): the backward that asked for the recompute reads them next, and a
    non-reentrant recompute may stop early, before any post-forward hook runs, so neither
    the active count nor a release may depend on one. (Releasing there was a use after
    release, and a stopped recompute left parameters counted active forever: gathered and
    stale after the step.)"""
    return torch._C._current_graph_task_id() != -1


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
        options: Any,
        group: Any,
        on_backward: Callable[[], None],
        on_tied_grad: Callable[[Any, Any], None] | None = None,
    ) -> None:
        self.on_backward = on_backward  # a backward pass reached a module: arm its end
        self.handles: list[Any] = []
        self.index: dict[int, int] = {}  # id(module) -> module index
        names: list[str] = []
        params: list[list[Any]] = []
        hooked: list[torch.nn.Module] = []  # modules whose own parameters the hooks gather
        self._register(root, "", names, params, hooked)
        self.tied: TiedAliases | None = None
        if on_tied_grad is not None:
            self.tied = TiedAliases(tied_names(hooked), on_tied_grad)
            restore = self.tied.restore
            for m in hooked:
                if self.tied.wants(m):
                    self.handles.append(m.register_forward_hook(restore, always_call=True))
        self.coordinator = GatherCoordinator(
            names,
            params,
            options.prefetch_numel,
            options.max_live_numel,
            options.max_reuse_distance,
            group,
        )
        self.params = params
        # prepended: the micro-step begins before the root's own parameters are fetched
        self.handles.append(root.register_forward_pre_hook(self._root_pre_forward, prepend=True))

    def _register(
        self,
        module: torch.nn.Module,
        name: str,
        names: list[str],
        params: list[list[Any]],
        hooked: list[torch.nn.Module],
    ) -> None:
        leaf = is_leaf_module(module)
        own = [p for p in module.parameters(recurse=leaf) if is_zero_param(p)]
        mine = own + [p for p in external_params(module) if all(p is not q for q in own)]
        if mine:
            self.index[id(module)] = len(names)
            names.append(name or type(module).__name__)
            params.append(mine)
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward))
            if not leaf:
                hooked.append(module)
        if not leaf:  # a leaf's children run inside its gather
            for child_name, child in module.named_children():
                child_path = f"{name}.{child_name}" if name else child_name
                self._register(child, child_path, names, params, hooked)

    def _root_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.coordinator.begin_forward()

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        i = self.index[id(module)]
        params = self.params[i]
        tied = self.tied is not None and self.tied.wants(module)
        if _recomputing():  # [Note: recompute under stage 3]
            self.coordinator.fetch(i, BACKWARD)
            if tied:
                self.tied.swap_in(module, alias=False)  # type: ignore[union-attr]
            return
        for p in params:
            p.ds_active += 1
        self.coordinator.fetch(i, FORWARD)
        if tied:
            self.tied.swap_in(module, alias=True)  # type: ignore[union-attr]
        if torch.is_grad_enabled():
            frozen = [p for p in params if not p.requires_grad]
            if frozen:
                for t in _tensors(args):
                    t.register_hook(lambda g, frozen=frozen: self._release(frozen, g))

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        i = self.index[id(module)]
        params = self.params[i]
        if _recomputing():  # the backward about to run reads them: they stay gathered
            return
        for p in params:
            p.ds_active -= 1
        if not self.coordinator.keep_after_forward(i):
            release_params(params)
        if torch.is_grad_enabled():
            fired = [False]

            def pre_backward(grad: torch.Tensor) -> torch.Tensor:
                if not fired[0]:
                    fired[0] = True
                    self.on_backward()
                    self.coordinator.fetch(i, BACKWARD)
                return grad

            for t in _tensors(output):
                t.register_hook(pre_backward)

    @staticmethod
    def _release(params: list[Any], grad: torch.Tensor) -> torch.Tensor:
        release_params(params)
        return grad

    def end_backward(self) -> None:
        self.coordinator.end_backward()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
