"""Which param group of a client optimizer (a torch.optim.Optimizer object built on the
model's params before deepspeed.initialize) each ZeRO group was made from, for the
strategies' repoint: that group then holds the ZeRO group's masters, and the client's groups
keep their number and order (schedulers built on them still fit)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def source_groups(optimizer: torch.optim.Optimizer, groups: Sequence[Sequence[Any]]) -> list[int]:
    """For each ZeRO group (its model params), the index of the client group holding all of
    them; every client group is emptied for the masters to go in."""
    owner = {id(p): i for i, og in enumerate(optimizer.param_groups) for p in og["params"]}
    sources: list[int] = []
    for params in groups:
        found = {owner.get(id(p), -1) for p in params}
        if len(found) != 1 or -1 in found:
            raise ValueError(
                "with ZeRO, the optimizer's param groups must be the model's groups: "
                "build the optimizer on the params given to deepspeed.initialize "
                "(model_parameters=, or the model's)"
            )
        sources.append(found.pop())
    for og in optimizer.param_groups:
        og["params"] = []
    return sources
