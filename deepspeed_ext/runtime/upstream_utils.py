"""Small helpers that upstream code imports from `deepspeed.runtime.utils`, with upstream's
names and signatures (partition_uniform and partition_balanced are the pipeline's own:
runtime/pipe/partition.py)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from typing import Any

import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's, numpy's (where installed) and torch's generators (numpy takes 32
    bits, torch 64)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def move_to_device(
    item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None
) -> Any:
    """Tensors in `item` (nested in lists, tuples and dicts) moved to `device` by changing
    their storage, so other references see the move too; with `criterion_func`, only the
    tensors it accepts. Returns `item` rebuilt around them; other objects pass unchanged."""
    if isinstance(item, torch.Tensor):
        if criterion_func is None or criterion_func(item):
            item.data = item.data.to(device)
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def is_invalid_grad_norm(norm: Any) -> bool:
    """A norm that is not finite or is negative (the overflow marker)."""
    if isinstance(norm, torch.Tensor):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or float(norm) < 0


def get_global_norm(norm_list: Iterable[Any]) -> float:
    """The 2-norm of norms (each a group's): inf when any of them is invalid."""
    norms = list(norm_list)
    if any(is_invalid_grad_norm(n) for n in norms):
        return float("inf")
    return math.sqrt(sum(float(n) ** 2 for n in norms))


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """`base(arg, ..., key=value)` with each value's repr."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"
