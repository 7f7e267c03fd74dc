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


_BUCKET_BYTES = 32 << 20  # one flat copy per bucket: memory beside the model stays small


def group_broadcast_many(
    tensors: list[torch.Tensor],
    group: AxisGroup,
    group_src: int = 0,
    bucket_bytes: int = _BUCKET_BYTES,
) -> None:
    """group_broadcast of each tensor, in one call per bucket of same-dtype tensors: each
    call is a round trip, and a model's hundreds of biases and norms made init wait on
    hundreds of them. A tensor of bucket_bytes or more goes alone, without a copy. Every
    rank must pass the same shapes and dtypes in the same order, as for group_broadcast."""
    if group.size <= 1:
        return
    open_: dict[tuple[torch.dtype, str], list[torch.Tensor]] = {}
    size: dict[tuple[torch.dtype, str], int] = {}

    def flush(key: tuple[torch.dtype, str]) -> None:
        bucket = open_.pop(key, [])
        size.pop(key, None)
        if len(bucket) == 1:
            group_broadcast(bucket[0], group, group_src)
        elif bucket:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            group_broadcast(flat, group, group_src)
            at = 0
            for t in bucket:
                t.copy_(flat[at : at + t.numel()].view(t.shape))
                at += t.numel()

    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        if nbytes >= bucket_bytes:
            group_broadcast(t, group, group_src)
            continue
        key = (t.dtype, t.device.type)  # device index differs by rank; the type does not
        if size.get(key, 0) + nbytes > bucket_bytes:
            flush(key)
        open_.setdefault(key, []).append(t)
        size[key] = size.get(key, 0) + nbytes
    for key in list(open_):
        flush(key)


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
