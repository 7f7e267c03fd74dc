"""Upstream deepspeed.comm's collectives, with torch.distributed's signatures (upstream's
are torch's): each resolves `group` (an AxisGroup, a process group, or None for the world)
and, in a world of one rank without a process group, acts as the identity.

These are the user-facing face (deepspeed.comm re-exports them); the runtime calls the
helpers in collectives.py and sharded.py, whose behaviour it relies on. Two things differ
from those helpers, as torch's own functions behave:
- async_op=True always returns a handle whose wait() works, a completed one where nothing
  moves (a group of one rank);
- all_reduce, broadcast, reduce and inference_all_reduce take a tensor that is not dense (a
  strided view such as x[::2], a transpose): they run on a dense copy and copy the result
  back (after wait() under async_op=True). The comm door (checked.py) still refuses such a
  tensor from the runtime's own calls, where one is a bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import checked
from .checked import ALL_GATHER_OP, REDUCE_SCATTER_OP, dist, is_dense
from .collectives import ReduceOp
from .handles import Completed, Joined
from .layout import AxisGroup, resolve


def _done(async_op: bool) -> Any:
    return Completed() if async_op else None


def _in_place(tensor: torch.Tensor, run: Callable[[torch.Tensor], Any]) -> Any:
    """run(t) on `tensor`, or, where it is not dense, on a dense copy whose result is copied
    back: gloo would move a view's storage as if it were dense."""
    if is_dense(tensor):
        return run(tensor)
    buf = tensor.contiguous()
    work = run(buf)
    if work is None:
        tensor.copy_(buf)
        return None
    return Joined([work], lambda: tensor.copy_(buf))


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    pg, size = resolve(group)
    if size == 1:
        return _done(async_op)
    return _in_place(tensor, lambda t: dist.all_reduce(t, op=op, group=pg, async_op=async_op))


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """src is a global rank (torch's convention)."""
    pg, size = resolve(group)
    if size == 1:
        return _done(async_op)
    return _in_place(tensor, lambda t: dist.broadcast(t, src=src, group=pg, async_op=async_op))


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    pg, size = resolve(group)
    if size == 1:
        tensor_list[0].copy_(tensor)
        return _done(async_op)
    return dist.all_gather(tensor_list, tensor, group=pg, async_op=async_op)


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
        return _done(async_op)
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
        return _done(async_op)
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
        return _done(async_op)
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
        return _done(async_op)
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
    if size == 1:
        return _done(async_op)
    return _in_place(tensor, lambda t: dist.reduce(t, dst, op=op, group=pg, async_op=async_op))


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
        return _done(async_op)
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
        return _done(async_op)
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
    return all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """output_tensor_list[i] gets input_tensor_list[rank] of group rank i."""
    pg, size = resolve(group)
    if size == 1:
        output_tensor_list[0].copy_(input_tensor_list[0])
        return _done(async_op)
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=pg, async_op=async_op)


def all_reduce_coalesced(
    tensors: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Each tensor all-reduced in place, in one flat all-reduce per dtype and device (torch's
    own all_reduce_coalesced is deprecated): every rank passes the same shapes and dtypes in
    the same order."""
    pg, size = resolve(group)
    if size == 1 or not tensors:
        return _done(async_op)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    flats = [(torch.cat([t.reshape(-1) for t in ts]), ts) for ts in buckets.values()]
    works = [dist.all_reduce(flat, op=op, group=pg, async_op=async_op) for flat, _ in flats]

    def copy_back() -> None:
        for flat, ts in flats:
            at = 0
            for t in ts:
                t.copy_(flat[at : at + t.numel()].view(t.shape))
                at += t.numel()

    if not async_op:
        copy_back()
        return None
    return Joined(works, copy_back)


def all_gather_coalesced(
    output_tensors: list[torch.Tensor],
    input_tensors: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """all_gather_into_tensor of each (output, input) pair."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError(
            f"all_gather_coalesced: {len(output_tensors)} output tensors for "
            f"{len(input_tensors)} input tensors"
        )
    pg, size = resolve(group)
    if size == 1:
        for out, inp in zip(output_tensors, input_tensors, strict=True):
            out.copy_(inp.view_as(out))
        return _done(async_op)
    gather = getattr(dist, ALL_GATHER_OP)
    works = [
        gather(out, inp, group=pg, async_op=async_op)
        for out, inp in zip(output_tensors, input_tensors, strict=True)
    ]
    return Joined(works) if async_op else None


class P2POp:
    """One send or receive of batch_isend_irecv: op is this module's isend or irecv (kept as
    its name, "isend" or "irecv"), peer a global rank."""

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: torch.Tensor,
        peer: int,
        group: Any = None,
        tag: int = 0,
    ) -> None:
        if op is isend:
            self.op = "isend"
        elif op is irecv:
            self.op = "irecv"
        else:
            raise ValueError(f"P2POp: op must be deepspeed.comm.isend or irecv, not {op!r}")
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Any]:
    """Start every send and receive of the list together; their handles, in its order."""
    return checked.batch_isend_irecv(
        [(p.op, p.tensor, p.peer, resolve(p.group)[0], p.tag) for p in p2p_op_list]
    )


def get_world_group() -> Any:
    """torch's default process group (None before one is made)."""
    return dist.group.WORLD


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of the process at index group_rank of `group` (None: the world)."""
    if isinstance(group, AxisGroup):
        return group.global_rank(group_rank)
    if group is None or not dist.is_initialized() or group is dist.group.WORLD:
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of `group` (None: the world), in group-rank order."""
    if isinstance(group, AxisGroup):
        return list(group.ranks)
    if not dist.is_initialized():
        return [0]
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return [int(r) for r in dist.get_process_group_ranks(group)]


def is_available() -> bool:
    return bool(dist.is_available())


def has_all_gather_into_tensor() -> bool:
    return hasattr(dist, ALL_GATHER_OP)


def has_reduce_scatter_tensor() -> bool:
    return hasattr(dist, REDUCE_SCATTER_OP)
