"""The rest of upstream deepspeed.comm's collectives, with torch.distributed's signatures
(upstream's are torch's): each resolves `group` (an AxisGroup, a process group, or None for
the world) and, in a world of one rank without a process group, acts as the identity."""

from __future__ import annotations

from typing import Any

import torch

from .checked import dist
from .collectives import ReduceOp
from .layout import resolve


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's name
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    pg, size = resolve(group)
    if size == 1:
        output.copy_(input.view_as(output))
        return None
    return dist.reduce_scatter_tensor(output, input, op=op, group=pg, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    pg, size = resolve(group)
    if size == 1:
        output.copy_(input_list[0])
        return None
    return dist.reduce_scatter(output, input_list, op=op, group=pg, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    pg, size = resolve(group)
    if size == 1:
        output_tensor.copy_(input_tensor.view_as(output_tensor))
        return None
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=pg, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's name
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    pg, size = resolve(group)
    if size == 1:
        output.copy_(input)
        return None
    return dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=pg, async_op=async_op
    )


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    pg, size = resolve(group)
    return None if size == 1 else dist.reduce(tensor, dst, op=op, group=pg, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    pg, size = resolve(group)
    if size == 1:
        if gather_list:
            gather_list[0].copy_(tensor)
        return None
    return dist.gather(tensor, gather_list, dst=dst, group=pg, async_op=async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    pg, size = resolve(group)
    if size == 1:
        if scatter_list:
            tensor.copy_(scatter_list[0])
        return None
    return dist.scatter(tensor, scatter_list, src=src, group=pg, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    dist.send(tensor, dst, group=resolve(group)[0], tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.recv(tensor, src, group=resolve(group)[0], tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return dist.isend(tensor, dst, group=resolve(group)[0], tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.irecv(tensor, src, group=resolve(group)[0], tag=tag)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive (gloo only, as in torch)."""
    pg, size = resolve(group)
    if size > 1:
        dist.monitored_barrier(group=pg, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """torch's signature (fills object_list); deepspeed_ext.comm.all_gather_object returns."""
    pg, size = resolve(group)
    if size == 1:
        object_list[0] = obj
        return
    dist.all_gather_object(object_list, obj, group=pg)


def broadcast_object_list(object_list: list[Any], src: int = 0, group: Any = None) -> None:
    pg, size = resolve(group)
    if size > 1:
        dist.broadcast_object_list(object_list, src=src, group=pg)


def inference_all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """Upstream's low-latency all-reduce for inference kernels; the same sum here."""
    pg, size = resolve(group)
    return None if size == 1 else dist.all_reduce(tensor, op=op, group=pg, async_op=async_op)
