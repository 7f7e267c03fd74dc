"""Collectives for sharded (ZeRO) data parallelism: a bucket reduce-scattered to its owners,
a bucket all-gathered back. Both async; both identities in a world of one."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .layout import resolve

# torch 2.13 renamed the flat collectives (*_single) and warns on every call of the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Done:
    def wait(self) -> None:
        return None


def reduce_scatter_bucket(out: torch.Tensor, bucket: torch.Tensor, group: Any = None) -> Any:
    """out (bucket.numel() / world) <- this rank's chunk of the sum of every rank's bucket.
    out may be this rank's own chunk of `bucket` (in place). group: an AxisGroup or a
    process group (None: the world)."""
    pg, size = resolve(group)
    if size == 1:
        if out.data_ptr() != bucket.data_ptr():
            out.copy_(bucket)
        return _Done()
    return _REDUCE_SCATTER(out, bucket, group=pg, async_op=True)


def all_gather_bucket(bucket: torch.Tensor, chunk: torch.Tensor, group: Any = None) -> Any:
    """bucket <- every rank's chunk, in group-rank order."""
    pg, size = resolve(group)
    if size == 1:
        bucket.copy_(chunk)
        return _Done()
    return _ALL_GATHER(bucket, chunk, group=pg, async_op=True)


def all_reduce_sum_(t: torch.Tensor, group: Any = None) -> None:
    pg, size = resolve(group)
    if size > 1:
        dist.all_reduce(t, group=pg)
