"""Thin collectives over torch.distributed with upstream deepspeed.comm's names.

Each is a no-op (or identity) in a world of one that never initialized a process group, so
single-process code paths need no special cases.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    if not _active():
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    if not _active():
        return None
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> Any:
    if not _active():
        tensor_list[0].copy_(tensor)
        return None
    return dist.all_gather(tensor_list, tensor, group=group)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def new_group(ranks: list[int] | None = None, backend: str | None = None) -> Any:
    """Every rank must call it, in the same order. backend="gloo" gives a CPU group beside
    an NCCL default (small host-side checks)."""
    return dist.new_group(ranks, backend=backend) if dist.is_initialized() else None


def get_backend(group: Any = None) -> str:
    return str(dist.get_backend(group)) if dist.is_initialized() else "none"
