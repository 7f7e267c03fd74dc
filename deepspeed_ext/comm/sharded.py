"""Collectives for sharded (ZeRO) data parallelism: a bucket reduce-scattered to its owners,
a bucket all-gathered back. Both async; both identities in a world of one.

[Note: in-place collectives on gloo]
gloo's flat reduce-scatter stages the whole bucket in a temporary (measured: +1x the bucket
per call in flight) and runs slower than an in-place all-reduce of the same bucket (about 2x
on 2 CPU ranks); its flat all-gather stages +1.5x. On gloo both therefore run as in-place
all-reduces of the bucket: the reduce-scatter all-reduces it and this rank's chunk is the
result; the all-gather zeroes the other ranks' chunks and all-reduces (a sum with zeros is
exact). ZeRO's memory bound (a few buckets in flight) then holds on the CPU too. NCCL keeps
its native collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.accelerator import get_accelerator

from .checked import all_gather_into, dist, is_host_group
from .layout import AxisGroup, resolve

# torch 2.13 renamed the flat collectives (*_single) and warns on every call of the old names.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Done:
    def wait(self) -> None:
        return None


class _Then:
    """A pending collective, and what to do once it is complete."""

    def __init__(self, work: Any, then: Any) -> None:
        self.work, self.then = work, then

    def wait(self, *args: Any) -> None:
        self.work.wait(*args)
        if self.then is not None:
            self.then()
            self.then = None


def _in_place(pg: Any) -> bool:
    return dist.get_backend(pg) == "gloo"


def _own_bounds(bucket: torch.Tensor, group: Any, pg: Any, size: int) -> tuple[int, int]:
    """[lo, hi) of this rank's chunk of the bucket."""
    rank = group.rank if isinstance(group, AxisGroup) else dist.get_rank(pg)
    c = bucket.numel() // size
    return rank * c, (rank + 1) * c


def reduce_scatter_bucket(out: torch.Tensor, bucket: torch.Tensor, group: Any = None) -> Any:
    """out (bucket.numel() / world) <- this rank's chunk of the sum of every rank's bucket.
    out may be this rank's own chunk of `bucket` (in place). group: an AxisGroup or a
    process group (None: the world)."""
    pg, size = resolve(group)
    if size == 1:
        if out.data_ptr() != bucket.data_ptr():
            out.copy_(bucket)
        return _Done()
    if _in_place(pg):  # [Note: in-place collectives on gloo]
        return _all_reduce_own(out, bucket, group, pg, size)
    return _REDUCE_SCATTER(out, bucket, group=pg, async_op=True)


def all_reduce_bucket(out: torch.Tensor, bucket: torch.Tensor, group: Any = None) -> Any:
    """reduce_scatter_bucket's result by an all-reduce of the whole bucket (every rank gets
    the sum; out takes this rank's chunk): zero_optimization.reduce_scatter false."""
    pg, size = resolve(group)
    if size == 1:
        if out.data_ptr() != bucket.data_ptr():
            out.copy_(bucket)
        return _Done()
    return _all_reduce_own(out, bucket, group, pg, size)


def _all_reduce_own(out: torch.Tensor, bucket: torch.Tensor, group: Any, pg: Any, size: int) -> Any:
    work = dist.all_reduce(bucket, group=pg, async_op=True)
    lo, hi = _own_bounds(bucket, group, pg, size)
    own = bucket[lo:hi]
    if own.data_ptr() == out.data_ptr():
        return work
    return _Then(work, lambda: out.copy_(own))


def all_gather_bucket(bucket: torch.Tensor, chunk: torch.Tensor, group: Any = None) -> Any:
    """bucket <- every rank's chunk, in group-rank order."""
    pg, size = resolve(group)
    if size == 1:
        bucket.copy_(chunk)
        return _Done()
    if _in_place(pg):  # [Note: in-place collectives on gloo]
        lo, hi = _own_bounds(bucket, group, pg, size)
        if bucket[lo:hi].data_ptr() != chunk.data_ptr():
            bucket[lo:hi].copy_(chunk)
        bucket[:lo].zero_()
        bucket[hi:].zero_()
        return dist.all_reduce(bucket, group=pg, async_op=True)
    return all_gather_into(bucket, chunk, group=pg, async_op=True)


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor handed to a collective over `group` must live: the accelerator's
    device (NCCL takes nothing else), or the host for a gloo side group."""
    pg, _ = resolve(group)
    if is_host_group(pg):
        return torch.device("cpu")
    return torch.device(get_accelerator().current_device_name())


def sums_over(values: list[float], group: Any = None) -> list[float]:
    """Element-wise sums of floats over the group's ranks: one collective, one host read."""
    pg, size = resolve(group)
    if size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(pg))
    dist.all_reduce(t, group=pg)
    return [float(x) for x in t.tolist()]


def sum_over(value: float, group: Any = None) -> float:
    """The sum of a float over the group's ranks (float64; itself over one rank)."""
    return sums_over([value], group)[0]


def sum_tensor_over(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """t summed over the group's ranks in place, on its device: no host read."""
    pg, size = resolve(group)
    if size > 1:
        dist.all_reduce(t, group=pg)
    return t
