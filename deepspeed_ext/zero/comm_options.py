"""[Note: ZeRO communication keys]
How ZeRO's collectives run, from upstream's zero_optimization keys:
- `overlap_comm`: given as false, each gradient bucket's reduction completes before the
  backward goes on (stages 1-3); otherwise up to two buckets reduce while the backward runs.
  Upstream's per-stage default (false below stage 3) is not taken as a request: this runtime
  overlaps at every stage unless told not to. At stage 3 the bucket being reduced and the one
  being filled share reduce_bucket_size's elements between them ([Note: stage-3 gradient
  reduction]), so overlapping costs no memory.
- `reduce_scatter`: false all-reduces each bucket, every rank keeping its own part of the sum,
  instead of reduce-scattering it (stages 1-3; the result is the same).
- `communication.topology` hierarchical: buckets reduce-scatter inside each node first, then
  across nodes ([Note: hierarchical reduce-scatter] in comm/hierarchical.py; stages 1-3).
- `allgather_bucket_size`: the most elements one all-gather of updated parameters moves
  (stages 1-2, counted over all ranks): a larger bucket is gathered in pieces. Stage 3 gathers
  parameters by stage3_prefetch_bucket_size, as upstream's does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepspeed_ext import comm


@dataclass(frozen=True)
class ReduceOptions:
    overlap: bool
    scatter: Callable[..., Any]  # (out, bucket, group=) -> work, as comm.reduce_scatter_bucket
    # ... over any other group (the node groups cut the data axis alone): spread experts'
    flat: Callable[..., Any]


def reduce_options(zero: Any, hierarchy: comm.NodeGroups | None = None) -> ReduceOptions:
    """hierarchy: `communication.topology` hierarchical's node groups of the data axis,
    whose reduce-scatter then runs in two steps ([Note: hierarchical reduce-scatter])."""
    overlap = bool(zero.overlap_comm) if "overlap_comm" in zero.model_fields_set else True
    flat = comm.reduce_scatter_bucket if zero.reduce_scatter else comm.all_reduce_bucket
    scatter = flat
    if hierarchy is not None:

        def scatter(out: Any, bucket: Any, group: Any = None) -> Any:
            return comm.reduce_scatter_bucket_hierarchical(out, bucket, hierarchy)

    return ReduceOptions(overlap, scatter, flat)
