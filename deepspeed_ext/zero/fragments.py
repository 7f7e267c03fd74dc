"""Upstream's `deepspeed.utils` tensor-fragment API: a parameter's fp32 master, gradient and
optimizer state, whole or this rank's part, whatever the ZeRO stage.

[Note: param fragments]
Each strategy says where a trainable parameter's values lie (`Strategy.fragment(p)`): in
tensors every data-parallel rank holds one of (the master, the reduced gradient, each
optimizer state tensor: the "owner"), `chunk` elements each, which laid end to end over the
ranks hold the parameter's `numel` elements from `start` on. chunk 0 means not partitioned:
the owner is the whole parameter on every rank (stage 0). The full value is then one
all-gather of the owners (collective: every data-parallel rank calls it, as upstream); this
rank's part is the owner's slice the parameter covers; setting writes each rank's slice.
A gradient is there between the backward that ends an accumulation window and step().
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from deepspeed_ext.comm import AxisGroup, all_gather

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Fragment:
    chunk: int  # elements per rank in each owner tensor; 0: the whole param on every rank
    start: int  # where the param begins in the ranks' owners laid end to end
    numel: int
    shape: torch.Size
    rank: int
    group: AxisGroup  # the data-parallel group the owners are spread over

    def local_range(self) -> tuple[int, int]:
        """[lo, hi) of this rank's owner that belong to the param (possibly empty)."""
        if self.chunk == 0:
            return 0, self.numel
        base = self.rank * self.chunk
        lo = max(self.start, base)
        hi = min(self.start + self.numel, base + self.chunk)
        return (lo - base, hi - base) if hi > lo else (0, 0)

    def full(self, owner: torch.Tensor, gathered: torch.Tensor | None = None) -> torch.Tensor:
        """gathered: the owners already laid end to end (gather(owner)), for several
        params of one owner at one collective."""
        if self.chunk == 0:
            return owner.detach().reshape(self.shape).clone()
        whole = self.gather(owner) if gathered is None else gathered
        return whole[self.start : self.start + self.numel].view(self.shape).clone()

    def gather(self, owner: torch.Tensor) -> torch.Tensor:
        """Every rank's owner, laid end to end (collective over the group)."""
        flat = owner.detach().reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.group.size)]
        all_gather(parts, flat.contiguous(), group=self.group)
        return torch.cat(parts)

    def local(self, owner: torch.Tensor) -> torch.Tensor:
        lo, hi = self.local_range()
        return owner.detach().reshape(-1)[lo:hi].clone()

    @torch.no_grad()
    def set_full(self, owner: torch.Tensor, value: torch.Tensor) -> None:
        value = value.detach().reshape(-1).to(owner.device, owner.dtype)
        if value.numel() != self.numel:
            raise ValueError(
                f"expected {self.numel} elements {tuple(self.shape)}, got {value.numel()}"
            )
        lo, hi = self.local_range()
        first = 0 if self.chunk == 0 else self.rank * self.chunk + lo - self.start
        owner.reshape(-1)[lo:hi].copy_(value[first : first + hi - lo])

    @torch.no_grad()
    def set_local(self, owner: torch.Tensor, value: torch.Tensor) -> None:
        lo, hi = self.local_range()
        value = value.detach().reshape(-1)
        if value.numel() != hi - lo:
            raise ValueError(
                f"this rank holds {hi - lo} elements of the param, got {value.numel()}"
            )
        owner.reshape(-1)[lo:hi].copy_(value.to(owner.device, owner.dtype))


def bind(params: list[Any], strategy: Any) -> None:
    """Let the module-level functions find a parameter's strategy (weakly: the engine owns
    it)."""
    ref = weakref.ref(strategy)
    for p in params:
        p._ds_fragment_owner = ref


def _strategy(param: Any) -> Any:
    ref = getattr(param, "_ds_fragment_owner", None)
    strategy = ref() if ref is not None else None
    if strategy is None:
        raise ValueError(
            "this parameter is not trained by a deepspeed engine (or its engine is gone): "
            "pass a parameter of engine.module"
        )
    return strategy


def _with_access(fn: F) -> F:
    """Run an accessor inside its strategy's fragment_access() where it has one (stage 3
    with NVMe optimizer offload swaps the masters and state in, and back out after)."""

    @functools.wraps(fn)
    def run(param: Any, *args: Any) -> Any:
        access = getattr(_strategy(param), "fragment_access", None)
        with access() if access is not None else contextlib.nullcontext():
            return fn(param, *args)

    return cast(F, run)


def _owner(param: Any, which: str) -> tuple[Fragment, torch.Tensor] | None:
    """which: "param" (fp32 master), "grad", or an optimizer state key ("exp_avg")."""
    strategy = _strategy(param)
    found = strategy.fragment_owner(param, which)
    if found is None and which not in ("param", "grad"):
        raise KeyError(f"the optimizer holds no state {which!r} for this parameter")
    return found


@_with_access
def safe_get_full_fp32_param(param: Any) -> torch.Tensor | None:
    found = _owner(param, "param")
    return found[0].full(found[1]) if found else None


@_with_access
def safe_get_full_grad(param: Any) -> torch.Tensor | None:
    found = _owner(param, "grad")
    return found[0].full(found[1]) if found else None


@_with_access
def safe_get_full_optimizer_state(param: Any, optim_state_key: str) -> torch.Tensor | None:
    found = _owner(param, optim_state_key)
    return found[0].full(found[1]) if found else None


@_with_access
def safe_set_full_fp32_param(param: Any, value: torch.Tensor) -> None:
    """Every data-parallel rank calls it with the same value; the model's copy follows."""
    found = _owner(param, "param")
    if found is None:
        raise ValueError("a frozen parameter has no fp32 master; set param.data")
    found[0].set_full(found[1], value)
    _strategy(param).write_model_param(param, value)


@_with_access
def safe_set_full_optimizer_state(param: Any, value: torch.Tensor, optim_state_key: str) -> None:
    found = _owner(param, optim_state_key)
    assert found is not None
    found[0].set_full(found[1], value)


@_with_access
def safe_get_local_fp32_param(param: Any) -> torch.Tensor | None:
    found = _owner(param, "param")
    return found[0].local(found[1]) if found else None


@_with_access
def safe_get_local_grad(param: Any) -> torch.Tensor | None:
    found = _owner(param, "grad")
    return found[0].local(found[1]) if found else None


@_with_access
def safe_get_local_optimizer_state(param: Any, optim_state_key: str) -> torch.Tensor | None:
    found = _owner(param, optim_state_key)
    return found[0].local(found[1]) if found else None


@_with_access
def safe_set_local_fp32_param(param: Any, value: torch.Tensor) -> None:
    """This rank's part only; the model's copy is refreshed at the next step (stages 1-3) or
    now (stage 0)."""
    found = _owner(param, "param")
    if found is None:
        raise ValueError("a frozen parameter has no fp32 master; set param.data")
    found[0].set_local(found[1], value)
    if found[0].chunk == 0:
        _strategy(param).write_model_param(param, value)


@_with_access
def safe_set_local_optimizer_state(param: Any, value: torch.Tensor, optim_state_key: str) -> None:
    found = _owner(param, optim_state_key)
    assert found is not None
    found[0].set_local(found[1], value)


def state_owner(optimizer: Any, master: torch.Tensor, which: str, grad: Any) -> Any:
    """The owner tensor for `which` given the master it belongs to."""
    if which == "param":
        return master
    if which == "grad":
        return grad
    state = optimizer.state.get(master, {}) if optimizer is not None else {}
    value = state.get(which)
    # per-element state has the master's shape ("step" and other scalars are not fragments)
    return value if torch.is_tensor(value) and value.shape == master.shape else None
