"""FusedOptimizer: the step FusedAdam and FusedLion share. Parameters are grouped by device;
each gets fp32 state on first use (so 16-bit params keep full-precision state); gradients go
in a dtype the kernel takes; non-contiguous params step through a contiguous copy. A subclass
names its state (STATE_KEYS), its ops (_builder) and launches the kernel (_launch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from .cpu_optimizer import load_state_dict_keeping_dtypes
from .light_optimizer import LightOptimizer


class FusedOptimizer(LightOptimizer):
    NAME: ClassVar[str]
    STATE_KEYS: ClassVar[tuple[str, ...]]

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], set_grad_none: bool):
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self._ops: dict[str, Any] = {}

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _builder(self, device_type: str) -> Any:
        """The op builder for parameters on this device type (None: not supported)."""
        raise NotImplementedError

    def _op(self, device_type: str) -> Any:
        if device_type not in self._ops:
            builder = self._builder(device_type)
            if builder is None:
                raise ValueError(f"{self.NAME}: parameters on {device_type} are not supported")
            self._ops[device_type] = builder().load()
        return self._ops[device_type]

    def _begin_group(self, group: dict[str, Any]) -> None:
        """Called once per group that has gradients, before its launches."""

    def _launch(
        self, op: Any, device: torch.device, group: dict[str, Any], lists: dict[str, list]
    ) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        if args or any(v is not None for v in kwargs.values()):
            raise RuntimeError(
                f"{self.NAME}.step() takes only a closure; grads/output_params/scale/grad_norms "
                "were removed upstream too"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not any(p.grad is not None for p in group["params"]):
                continue
            self._begin_group(group)
            by_device: dict[torch.device, dict[str, list[torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self.NAME} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    for key in self.STATE_KEYS:
                        state[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                lists = by_device.setdefault(
                    p.device, {"p": [], "g": [], **{k: [] for k in self.STATE_KEYS}}
                )
                lists["p"].append(p.data)
                # the CPU kernels take any float grad dtype; the CUDA ones the param's or fp32
                ok = (
                    (p.dtype, torch.float32)
                    if p.is_cuda
                    else (torch.float32, torch.bfloat16, torch.float16)
                )
                g = p.grad if p.grad.dtype in ok else p.grad.float()
                lists["g"].append(g.contiguous())
                for key in self.STATE_KEYS:
                    lists[key].append(state[key])
            for device, lists in by_device.items():
                # the kernels need contiguous params: step a contiguous copy, copy it back
                given = lists["p"]
                lists["p"] = [p if p.is_contiguous() else p.contiguous() for p in given]
                self._launch(self._op(device.type), device, group, lists)
                for dst, src in zip(given, lists["p"]):
                    if dst is not src:
                        dst.copy_(src)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Also another optimizer's (torch.optim.Adam's, say, when a run switches): options
        its groups lack take this optimizer's defaults, and the subclass adopts its state."""
        load_state_dict_keeping_dtypes(self, state_dict, lambda p: torch.float32)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self._adopt(group)

    def _adopt(self, group: dict[str, Any]) -> None:
        """A loaded group's state in this optimizer's form (nothing to change by default)."""
