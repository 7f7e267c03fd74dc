"""Build a schedule from a config's `scheduler: {type, params}` section.

As upstream's engine does, a type that is not one of ours is looked up in
torch.optim.lr_scheduler, so `"type": "StepLR"` works too. Params are checked against the
constructor before it runs, so a typo fails with the key's name rather than a bare TypeError.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

import torch.optim.lr_scheduler as torch_schedulers

from .base import OptimizerLike
from .one_cycle import OneCycle
from .range_test import LRRangeTest
from .warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

SCHEDULES: dict[str, type] = {
    cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}


def _torch_schedule(name: str) -> type | None:
    obj = getattr(torch_schedulers, name, None)
    if isinstance(obj, type) and issubclass(obj, torch_schedulers.LRScheduler):
        return obj
    return None


def _torch_names() -> list[str]:
    return [n for n in dir(torch_schedulers) if not n.startswith("_") and _torch_schedule(n)]


def _suggest(word: str, choices: list[str]) -> str:
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def _check_params(name: str, cls: type, params: Mapping[str, Any]) -> None:
    sig = inspect.signature(cls)
    accepted = list(sig.parameters)[1:]  # the first is the optimizer
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    for key in params:
        if key not in accepted and not takes_any:
            raise ValueError(
                f"scheduler {name}: unknown param {key!r}{_suggest(key, accepted)} "
                f"(accepted: {', '.join(accepted)})"
            )
    missing = [
        p.name
        for p in list(sig.parameters.values())[1:]
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in params
    ]
    if missing:
        raise ValueError(f"scheduler {name}: missing required param(s) {', '.join(missing)}")


def get_lr_scheduler(
    name: str, optimizer: OptimizerLike, params: Mapping[str, Any] | None = None
) -> Any:
    """The schedule `name` (one of VALID_LR_SCHEDULES, or a torch.optim.lr_scheduler class)
    built on `optimizer` with keyword `params`; ValueError naming a bad type or param."""
    cls = SCHEDULES.get(name) or _torch_schedule(name)
    if cls is None:
        known = list(SCHEDULES)
        raise ValueError(
            f"unknown scheduler type {name!r}{_suggest(name, known + _torch_names())} "
            f"(DeepSpeed schedules: {', '.join(known)}; or a torch.optim.lr_scheduler class)"
        )
    params = dict(params or {})
    _check_params(name, cls, params)
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError) as exc:  # a value of the wrong type or range
        raise ValueError(
            f"scheduler.params for {name!r} are not accepted: {exc} (given: {params})"
        ) from None
