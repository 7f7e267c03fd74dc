"""`communication` (a section DeepSpeed's guides print without defining it; defined here and
in the README's "hierarchical all-reduce" and "slow nodes" rows): how the data-parallel
gradient all-reduce crosses nodes, and how slow ranks are found."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..types import Float, Int, Section


class CommunicationConfig(Section):
    # "flat": one all-reduce over the data-parallel group; "hierarchical": within each node,
    # across nodes piece by piece, within each node again ([Note: hierarchical all-reduce])
    topology: Literal["flat", "hierarchical"] = "flat"
    # ranks on each node (consecutive global ranks); default: the launcher's
    # LOCAL_WORLD_SIZE
    ranks_per_node: Int | None = Field(default=None, ge=1)
    # [Note: slow nodes]: every slow_node_interval optimizer steps (None: 50) every rank's
    # compute time over those steps is gathered; a rank above the median by more than this
    # fraction (0.25: 25% slower) is named, with its host, in the log and the metrics.
    # None: off.
    slow_node_tolerance: Float | None = Field(default=None, gt=0)
    slow_node_interval: Int | None = Field(default=None, ge=1)

    def active(self) -> bool:
        return self.topology != "flat" or self.slow_node_tolerance is not None
