"""Shared machinery of the CPU optimizers (Adam, Adagrad, Lion): state, grouping, checks.

[Note: optimizer state dtype]
With fp32_optimizer_states=True (the default, as upstream) states are float32 whatever the
param dtype, and the kernel does its math in fp32, rounding only the stored param.
torch.optim.Optimizer.load_state_dict casts every state tensor to the param's dtype, which
would silently truncate fp32 states of bf16 params; load_state_dict below restores them
from the saved tensors at full precision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from .light_optimizer import LightOptimizer

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPUOptimizer(LightOptimizer):
    STATE_KEYS: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, params: Iterable[Any], defaults: dict[str, Any], fp32_optimizer_states: bool
    ) -> None:
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states
        self._op: Any = None

    # -- subclass hooks --------------------------------------------------------------------------
    def _load_op(self) -> Any:
        raise NotImplementedError

    def _apply(self, op: Any, group: dict[str, Any], step: int, lists: dict[str, list]) -> None:
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------
    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else p.dtype

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            for k in self.STATE_KEYS:
                state[k] = torch.zeros(p.shape, dtype=self._state_dtype(p), device=p.device)
        return state

    def _check_group(self, group: dict[str, Any]) -> None:
        """A group's values as the constructor checks them: a group can be given its own (an
        lr of -1, amsgrad) where the constructor never saw them, and a failed kernel call
        after the step count moved put bias correction a step off."""
        name = type(self).__name__
        if group.get("amsgrad"):
            raise ValueError(f"{name} does not support amsgrad=True (a param group sets it)")
        check_hparams(
            name,
            group["lr"],
            group.get("eps"),
            group.get("betas"),
            group.get("weight_decay", 0.0),
        )

    def _check_param(self, p: torch.Tensor) -> None:
        name = type(self).__name__
        if p.device.type != "cpu":
            raise ValueError(
                f"{name} steps CPU tensors, but a parameter of shape {tuple(p.shape)} is on "
                f"{p.device}. Use FusedAdam for device parameters, or enable "
                "'offload_optimizer': {'device': 'cpu'} in the ZeRO config."
            )
        if p.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: parameter dtype {p.dtype} is not fp32, bf16 or fp16")
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(f"{name} does not support sparse gradients")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._op is None:
            self._op = self._load_op()
        for group in self.param_groups:  # all of them before any state moves
            self._check_group(group)
        for group in self.param_groups:
            # One kernel call per distinct step count (normally one per group).
            buckets: dict[int, dict[str, list]] = {}
            write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._check_param(p)
                state = self._init_state(p)
                state["step"] += 1
                data = p.data
                if not data.is_contiguous():
                    data = data.contiguous()
                    write_back.append((p.data, data))
                grad = p.grad
                if grad.dtype not in _FLOAT_DTYPES:
                    grad = grad.float()
                lists = buckets.setdefault(
                    state["step"], {"params": [], "grads": [], **{k: [] for k in self.STATE_KEYS}}
                )
                lists["params"].append(data)
                lists["grads"].append(grad.contiguous())
                for k in self.STATE_KEYS:
                    lists[k].append(state[k])
            for step, lists in buckets.items():
                self._apply(self._op, group, step, lists)
            for dst, src in write_back:
                dst.copy_(src)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_state_dict_keeping_dtypes(self, state_dict, self._state_dtype)


def load_state_dict_keeping_dtypes(
    opt: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    state_dtype: Callable[[torch.Tensor], torch.dtype],
) -> None:
    """torch's load_state_dict, then state tensors re-taken from the saved ones at
    state_dtype(param) instead of the param's dtype (see [Note: optimizer state dtype])."""
    saved = state_dict["state"]
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    LightOptimizer.load_state_dict(opt, state_dict)  # type: ignore[arg-type]
    for pid, p in zip(ids, params):
        for k, v in saved.get(pid, {}).items():
            if k == "step":
                opt.state[p][k] = int(v)
            elif torch.is_tensor(v):
                # contiguous: torch keeps a transposed param's moments in its strides, and
                # the kernels take dense state
                state = v.to(dtype=state_dtype(p), device=p.device, copy=True)
                opt.state[p][k] = state.contiguous()


_MAX = 1e30  # the bindings' range for lr, eps and weight_decay


def check_hparams(
    name: str, lr: float, eps: float | None, betas: tuple[float, float] | None, weight_decay: float
) -> None:
    """The same ValueErrors torch.optim raises, naming the optimizer; and the kernels' upper
    bound (1e30: beyond it, and at inf, their arithmetic is no longer meaningful in fp32)."""
    if not 0.0 <= lr <= _MAX:
        raise ValueError(f"{name}: invalid learning rate lr={lr} (must be in [0, 1e30])")
    if eps is not None and not 0.0 <= eps <= _MAX:
        raise ValueError(f"{name}: invalid eps={eps} (must be in [0, 1e30])")
    if betas is not None:
        if len(betas) != 2:
            raise ValueError(f"{name}: betas must be two values (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{name}: invalid betas[{i}]={b} (must be in [0, 1))")
    if not 0.0 <= weight_decay <= _MAX:
        raise ValueError(f"{name}: invalid weight_decay={weight_decay} (must be in [0, 1e30])")
