"""What every batch-indexed schedule shares: optimizer unwrapping, per-group values, stepping.

[Note: batch index] A schedule's position is `last_batch_iteration`, the index of the last
batch trained (-1: none yet). `step()` moves it by one and writes `get_lr()` into the
optimizer's param groups. A fresh schedule (-1) writes its starting values at construction,
so the very first optimizer step already follows it; one built with a resumed index leaves
the optimizer alone until its first `step()`. The state is that one integer, as upstream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import torch
from torch.optim import Optimizer


class WrapsOptimizer(Protocol):
    """A wrapper (ZeRO, fp16) exposing the torch optimizer whose groups it steps."""

    optimizer: Optimizer


OptimizerLike: TypeAlias = Optimizer | WrapsOptimizer
FloatOrList: TypeAlias = float | Sequence[float]


def get_torch_optimizer(optimizer: object) -> Optimizer:
    """The torch optimizer itself, or the one a wrapper holds in `.optimizer`."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(
        f"{type(optimizer).__name__} is not a torch.optim.Optimizer "
        "and has no torch.optim.Optimizer in `.optimizer`"
    )


def number(value: object, name: str, expected: str = "a number") -> float:
    """`value` as a float; a TypeError naming `name` for a string or anything not a number
    (a string is a Sequence, and would otherwise be read as one value per character)."""
    if not isinstance(value, (str, bytes)):
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
    hint = " (a string: write the number without quotes)" if isinstance(value, str) else ""
    raise TypeError(f"{name} must be {expected}, got {value!r}{hint}")


def per_group(optimizer: Optimizer, value: FloatOrList, name: str) -> list[float]:
    """One value per param group: a scalar is broadcast, a list must match the group count."""
    n = len(optimizer.param_groups)
    expected = f"a number or a list of numbers, one per param group ({n})"
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != n:
            raise ValueError(f"{name}: expected {n} values (one per param group), got {len(value)}")
        return [number(v, name, expected) for v in value]
    return [number(value, name, expected)] * n


def update_lr(param_groups: list[dict[str, Any]], lrs: Sequence[float]) -> list[Any]:
    """Write `lrs` into the groups and return what the groups now hold. A group whose lr is
    a tensor (torch takes one, e.g. for a captured graph) keeps that tensor, filled in place,
    so what holds a reference to it sees the schedule."""
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


class BatchSchedule:
    """Base of the schedules; see [Note: batch index]."""

    def __init__(self, optimizer: OptimizerLike, last_batch_iteration: int = -1) -> None:
        self.optimizer = get_torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[Any] | None = None  # what the last write left in the groups

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        self._advance(last_batch_iteration)

    def get_last_lr(self) -> list[Any]:
        """The lrs last written into the optimizer (a group's tensor lr, as upstream)."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}: call step() before get_last_lr()")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])

    def _start(self) -> None:
        """Called at the end of a subclass's __init__, once get_lr() can run."""
        if self.last_batch_iteration == -1:
            self._apply()

    def _advance(self, batch_iteration: int | None) -> None:
        if batch_iteration is None:
            batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = batch_iteration
        self._apply()

    def _apply(self) -> None:
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())
