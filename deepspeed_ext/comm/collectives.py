"""Thin collectives over torch.distributed with upstream deepspeed.comm's names.

Each is a no-op (or identity) in a world of one that never initialized a process group, so
single-process code paths need no special cases.
"""

from __future__ import annotations

from typing import Any

import torch

from .checked import dist
from .layout import AxisGroup, resolve

ReduceOp = dist.ReduceOp

# Every `group` below is an AxisGroup (comm/layout.py), a torch process group, or None (the
# world); over a group of one rank each call is a no-op or the identity.


def barrier(group: Any = None) -> None:
    pg, size = resolve(group)
    if size > 1:
        dist.barrier(group=pg)


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    pg, size = resolve(group)
    if size == 1:
        return None
    return dist.all_reduce(tensor, op=op, group=pg, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """src is a global rank (torch's convention); group_broadcast takes a group rank."""
    pg, size = resolve(group)
    if size == 1:
        return None
    return dist.broadcast(tensor, src=src, group=pg, async_op=async_op)


def group_broadcast(tensor: torch.Tensor, group: AxisGroup, group_src: int = 0) -> None:
    """Broadcast from the rank at index group_src of an AxisGroup (a non-contiguous tensor,
    such as a parameter made from a transpose, through a dense copy: the comm door refuses
    views, which gloo would fill wrongly)."""
    if group.size > 1:
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        dist.broadcast(buf, src=group.global_rank(group_src), group=group.group)
        if buf is not tensor:
            tensor.copy_(buf)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> Any:
    pg, size = resolve(group)
    if size == 1:
        tensor_list[0].copy_(tensor)
        return None
    return dist.all_gather(tensor_list, tensor, group=pg)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    pg, size = resolve(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=pg)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """src is a global rank."""
    pg, size = resolve(group)
    if size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=pg)
    return box[0]


def new_group(ranks: list[int] | None = None, backend: str | None = None) -> Any:
    """Every rank must call it, in the same order. backend="gloo" gives a CPU group beside
    an NCCL default (small host-side checks)."""
    return dist.new_group(ranks, backend=backend) if dist.is_initialized() else None


def get_backend(group: Any = None) -> str:
    return str(dist.get_backend(group)) if dist.is_initialized() else "none"
